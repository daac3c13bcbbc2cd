#!/bin/bash
# The sweeps behind runs/coverage, runs/compute_optimal and runs/small_vs_large (issue 49), as
# resumable `metaloom eval` sweeps: rerun the same line after an interruption and it goes on
# where it stopped (problems in order, every strategy of a problem before the next problem).
#
#   bash runs/sweeps.sh countdown        # Qwen2.5-Coder-0.5B on countdown: sampling at N = 64 and three searches
#
# The searches' sizes are chosen by FLOPs: step beam search with 8 paths costs about what the 1.5B's
# greedy does (0.5-0.6 TFLOP a puzzle), particle filtering and REBASE with 16 about what its vote
# at N = 2-4 does (about 1 TFLOP), inside the 1.5B's curve N = 1..8 (0.6-1.7 TFLOP), so the
# equal-compute table can read them against it.
#   bash runs/sweeps.sh gsm              # Qwen2.5-Coder-0.5B on gsm_symbolic: sampling at N = 64
#   bash runs/sweeps.sh countdown-1.5b   # Qwen2.5-Coder-1.5B on countdown: greedy, sampling at N = 8
#   bash runs/sweeps.sh game24-1.5b      # Qwen2.5-Coder-1.5B on the 24 game (runs/game24's problems)
#
# Seed 2611 (problem i is reasoning-gym's item i of seed 2611), one thread per sweep, two sweeps
# side by side, nice 10 (on a 2-core machine shared with other work: a Ray worker runs at nice 19
# under a nice-10 driver, 7x less CPU share than nice 10, and a one-thread process waits on no
# descheduled sibling thread).
# Weights: native (the GGUF's quantised blocks, float32 activations): on the AMD EPYC Zen 3 (AVX2)
# they decode 64 countdown samples about 1.15x as fast as dense bfloat16 here, and batch-1
# greedy about 2x (docs/performance.md), which the searches' small batches are closer to.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?countdown, gsm, countdown-1.5b or game24-1.5b}
BIN=${BIN:-.venv/bin}
M05=${M05:-/work/models/qwen2.5-coder-0.5b.gguf}
M15=${M15:-/work/models/qwen2.5-coder-1.5b.gguf}
one=(--threads 1)
export HF_HUB_OFFLINE=1

case $what in
countdown)
    C="step_scorer=countdown,final_scorer=countdown,step_tokens=48"
    nice -n 10 "$BIN/metaloom" eval --task countdown --limit 40 --seed 2611 --model "$M05" --weights native \
        --max-tokens 96 --out runs/coverage/countdown "${one[@]}" \
        --strategies greedy "majority_vote@n=64" "best_of_n@n=64,scorer=countdown" "best_of_n@n=64,scorer=logprob" \
        "step_beam_search@n=8,beam_width=4,$C" "particle_filtering@n=16,$C" "rebase@n=16,$C"
    ;;
gsm)
    # q8 activations (--activations q8: int8 inputs, integer products): 16 x 64 samples run 1.6-1.8x
    # as fast as float activations on the AMD EPYC Zen 3 (docs/performance.md, "Integer
    # activations"), at a perplexity cost under 0.2%; 64 samples of 256 tokens a problem need it here
    nice -n 10 "$BIN/metaloom" eval --task gsm --limit 40 --seed 2611 --model "$M05" --weights native \
        --activations q8 --max-tokens 256 --out runs/coverage/gsm "${one[@]}" \
        --strategies "majority_vote@n=64" "best_of_n@n=64,scorer=logprob" "weighted_vote@n=64,scorer=logprob,transform=exp"
    ;;
countdown-1.5b)
    nice -n 10 "$BIN/metaloom" eval --task countdown --limit 40 --seed 2611 --model "$M15" --weights native \
        --max-tokens 96 --out runs/small_vs_large/countdown-1.5b "${one[@]}" \
        --strategies greedy "majority_vote@n=8" "best_of_n@n=8,scorer=countdown"
    ;;
game24-1.5b)
    # runs/game24's problems and max tokens (its 0.5B searches ran with dense bfloat16 weights; FLOPs
    # are the model's formula either way)
    nice -n 10 "$BIN/metaloom" eval --task game24 --limit 40 --seed 2611 --model "$M15" --weights native \
        --max-tokens 128 --out runs/small_vs_large/game24-1.5b "${one[@]}" \
        --strategies greedy "majority_vote@n=8" "best_of_n@n=8,scorer=game24"
    ;;
*)
    echo "unknown sweep $what (countdown, gsm, countdown-1.5b, game24-1.5b)" >&2
    exit 2
    ;;
esac
