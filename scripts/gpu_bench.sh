#!/usr/bin/env bash
# Issue 35's one-shot GPU benchmark (metaloom bench gpu), run from a copy of the working tree on a
# GPU machine without network: python3 there has torch, transformers and the rest, not metaloom
# (it runs from the tree: PYTHONPATH), nor gguf, llguidance, math-verify, fastapi, uvicorn, openai
# (not needed on this path). What it reads, carried in the ignored folder .gpu/ (made here by
# scripts/gpu_prepare.sh):
#   .gpu/tokenizer/  the default model's tokenizer files (the shapes' vocabulary and prompts)
#   .gpu/baseline/   `git archive c73a4ef metaloom`: the engine before CUDA graphs, the baseline rows
#   .gpu/whl/        wheels installed to /tmp/site first, if any
#
#   scripts/gpu_bench.sh          # writes $OUT/log.txt, $OUT/smoke.json, $OUT/gpu-decode.json
#
# 1. versions and the GPU; 2. a smoke check: metaloom's token ids with METALOOM_CUDA_GRAPHS on
# and off (135m: greedy, 4 seeded samples) must be equal in float32, and are compared in
# bfloat16 (where two correct paths that round differently may part at a near tie: reported);
# 3. the benchmark, most important first (1b every case, 7b greedy and 16 samples, 135m, then
# 7b's 64 samples if time is left), under a time budget so the whole script ends within
# GPU_BENCH_LIMIT_S; the JSON is rewritten after every cell, so a run cut short keeps what it
# measured. Environment knobs (defaults for an H100):
#   OUT                    where results go (default /tmp/gpu-bench-out)
#   GPU_BENCH_PYTHON       interpreter (default python3)
#   GPU_BENCH_DEVICE       cuda (cpu for a dry run here)
#   GPU_BENCH_SHAPES       the benchmark's --shapes (default 1b,7b:greedy+s16,135m,7b:s64); a case list
#                          may name spec (batch-1 greedy with n-gram speculative decoding: metaloom
#                          graphs and eager speculating, and graphs without speculation; not a default case)
#   GPU_BENCH_SPEC         shapes (comma-separated) that run the spec case first among their cases, e.g.
#                          1b: SHAPES' item of that shape gets spec in front (1b -> 1b:spec+greedy+s16+s64),
#                          or "SHAPE:spec" goes in front of SHAPES where it has no item (default none)
#   GPU_BENCH_SPEC_DRAFT   the spec case's drafts a step, --spec-draft (default 4)
#   GPU_BENCH_SMOKE_SHAPES the smoke's shapes (default 135m; none: no smoke)
#   GPU_BENCH_SMOKE_S      seconds before the smoke is killed as a hang (default 180: on an H200 lent
#                          2026-11-29, whose host ran eager steps at half an H100 host's speed, the
#                          135m smoke took 90 s and was killed as it wrote its JSON at the old 90)
#   GPU_BENCH_EXTRA        more arguments for both (e.g. "--max-tokens 4 --dtype float32" on a CPU)
#   GPU_BENCH_LIMIT_S      seconds for the whole script (default 420)
#   GPU_BENCH_CHECKS_S     > 0: also run scripts/gpu_checks.py (the engine's exactness, capture-fidelity
#                          and step-time checks) after the smoke, killed after that many seconds;
#                          its time comes out of the benchmark's budget (default 0: not run)
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu-bench-out}
PY=${GPU_BENCH_PYTHON:-python3}
DEVICE=${GPU_BENCH_DEVICE:-cuda}
SHAPES=${GPU_BENCH_SHAPES:-1b,7b:greedy+s16,135m,7b:s64}
SMOKE_SHAPES=${GPU_BENCH_SMOKE_SHAPES:-135m}
LIMIT_S=${GPU_BENCH_LIMIT_S:-420}
CHECKS_S=${GPU_BENCH_CHECKS_S:-0}
SMOKE_S=${GPU_BENCH_SMOKE_S:-180}
SPEC=${GPU_BENCH_SPEC:-}
SPEC_DRAFT=${GPU_BENCH_SPEC_DRAFT:-4}
DEFAULT_CASES=greedy+s16+s64  # the benchmark's default --cases, for a shape item that names none
read -r -a EXTRA <<< "${GPU_BENCH_EXTRA:-}"
STARTED=$(date +%s)
mkdir -p "$OUT"

elapsed() { echo $(( $(date +%s) - STARTED )); }

# SHAPES with the spec case first for each shape of SPEC (see GPU_BENCH_SPEC)
with_spec() {
    local -a items
    local -a spec_shapes
    local s i found
    IFS=, read -r -a items <<< "$SHAPES"
    IFS=, read -r -a spec_shapes <<< "$SPEC"
    for s in "${spec_shapes[@]}"; do
        [[ -n "$s" ]] || continue
        found=0
        for i in "${!items[@]}"; do
            if [[ "${items[$i]%%:*}" == "$s" ]]; then
                if [[ "${items[$i]}" == *:* ]]; then
                    [[ "+${items[$i]#*:}+" == *+spec+* ]] || items[$i]="$s:spec+${items[$i]#*:}"
                else
                    items[$i]="$s:spec+$DEFAULT_CASES"
                fi
                found=1
                break
            fi
        done
        (( found )) || items=("$s:spec" "${items[@]}")
    done
    (IFS=,; echo "${items[*]}")
}
[[ -n "$SPEC" ]] && SHAPES=$(with_spec)

main() {
    local site=""
    if compgen -G ".gpu/whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && site=/tmp/site
    fi
    export PYTHONPATH="${site:+$site:}$REPO${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    echo "== $(date -u +%FT%TZ) $(hostname) in $REPO, PYTHONPATH=$PYTHONPATH"
    command -v nvidia-smi > /dev/null && nvidia-smi -L && \
        nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
    echo "gcc: $(command -v gcc || echo none) (inductor's kernels need a C compiler)"
    "$PY" - <<'EOF'
import importlib.metadata as md, sys
import torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), {n: v(n) for n in ("transformers", "triton", "tokenizers", "numpy")})
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory // 2**20, "MiB")
import metaloom
print("metaloom from", metaloom.__file__)
EOF
    local common=(--tokenizer .gpu/tokenizer --device "$DEVICE" "${EXTRA[@]}")

    local systems=()
    if [[ "$SMOKE_SHAPES" != none ]]; then
        echo "== smoke at $(elapsed) s: METALOOM_CUDA_GRAPHS on vs off, token ids"
        timeout -k 10 "$SMOKE_S" "$PY" -m metaloom.cli bench gpu --smoke --shapes "$SMOKE_SHAPES" "${common[@]}" \
            --out "$OUT/smoke.json"
        local smoke=$?
        echo "smoke exit status $smoke (0: equal in float32, 1: different in float32, other: failed)"
        if (( smoke != 0 && smoke != 1 )); then  # a crash or a hang may poison the CUDA context: no graphs rows
            systems=(--systems eager,baseline,tf-eager,tf-static)
            echo "the smoke failed: the benchmark runs without the metaloom graphs rows"
        fi

    fi

    if (( CHECKS_S > 0 )) && [[ -f scripts/gpu_checks.py ]]; then
        echo "== engine checks at $(elapsed) s (scripts/gpu_checks.py, at most $CHECKS_S s)"
        timeout -k 10 "$CHECKS_S" "$PY" scripts/gpu_checks.py --tokenizer .gpu/tokenizer --out "$OUT/checks.json"
        echo "checks exit status $?"
    fi

    local budget=$(( LIMIT_S - $(elapsed) - 15 ))
    echo "== benchmark at $(elapsed) s, budget $budget s: shapes $SHAPES"
    local baseline=()
    [[ -f .gpu/baseline/metaloom/__init__.py ]] && baseline=(--baseline-path .gpu/baseline)
    timeout -s INT -k 10 $(( budget + 20 )) "$PY" -m metaloom.cli bench gpu --shapes "$SHAPES" "${common[@]}" \
        --spec-draft "$SPEC_DRAFT" --repeats 3 --budget-s "$budget" "${baseline[@]}" "${systems[@]}" --out "$OUT/gpu-decode.json"
    echo "benchmark exit status $? at $(elapsed) s"
    ls -la "$OUT"
}

main 2>&1 | tee "$OUT/log.txt"
