"""`metaloom bench gpu`: the local engine on a GPU against transformers, on random-weight Llama
models built on the device (issue 35: decoding at the memory-bandwidth limit).

Shapes (`metaloom.bench.gpu_worker.SHAPES`, bfloat16 by default, the tokenizer's vocabulary):
``135m`` (SmolLM2-135M), ``1b`` (Llama-3.2-1B's proportions), ``7b`` (Llama-3-8B's layers,
~7.4B parameters with SmolLM2's 49,152 tokens), ``tiny`` (for tests on the CPU). Each shape's
weights are drawn once on the device from a seeded generator; transformers and metaloom run
the same tensors; each shape is freed before the next. ``--shapes 1b,7b:greedy+s16,135m`` runs
shapes in that order, each with the cases named after its colon (default ``--cases``).

Cases, the same prompt token ids for every system, end of sequence ignored so every sample is
exactly as long as asked (another count is an error on the row): ``greedy`` batch-1 greedy, 128
tokens from the chat-templated prompt of `metaloom bench decode`; ``s16`` 16 samples x 64
tokens from its ~350-token prompt at temperature 1, seeded; ``s64`` 64 samples x 128 tokens
from the same prompt (the issue's target); ``spec`` (only when named: not in the default
``--cases``) batch-1 greedy, 128 tokens, with speculative decoding: metaloom's n-gram drafter
(prompt lookup) proposes ``--spec-draft`` K tokens a step and the target verifies the pending
token and the drafts in one forward (the static, CUDA-graph-captured step where graphs are on),
on a chat-templated prompt asking to copy a passage it holds (`COPY_PROMPT`: input-grounded, so
drafts can be accepted; with random weights acceptance is whatever it is, and the rows report
it). ``--max-tokens`` caps the lengths (tests).

Systems (rows): ``graphs`` / ``eager``: one `LocalGenerator` with METALOOM_CUDA_GRAPHS ``on`` /
``off`` around each call (the engine reads it at each step); ``graphs-torch``: graphs on with
METALOOM_TRITON=off (the captured step in PyTorch ops, without the fused Triton kernels that
``graphs`` uses where Triton runs, `metaloom.models.kernels.gpu_triton`); ``graphs-mixed``: graphs
on with Triton's step above `graphs.TRITON_ROWS` rows too, attention there by gather + SDPA
(METALOOM_TRITON_ROWS; only when named: not in the default ``--systems``; the same as ``graphs``
while `graphs.TRITON_ROWS` is every bucket); ``tf-eager``: transformers
``generate`` with its DynamicCache; ``tf-static``: ``generate`` with a static cache, which
transformers compiles on CUDA (torch.compile, CUDA graphs): its warm-up (two calls) holds the
compilation, reported apart, and it is timed after the other rows of its case (not alternated
with them: a compilation that runs long cannot cost them their rounds); a compilation that
fails is the row's note and the row is measured without it; one that would not fit the time
left (``--compile-s``, an estimate, and at most ``--compile-share`` of the budget for all
compilations) is skipped with that reason;
``baseline``: the ``metaloom`` package in ``--baseline-path DIR`` (an older copy) measured in a
worker process (`metaloom.bench.gpu_worker`) on the same weights (same seed; the checksum is
compared), for ``--baseline-cases`` only. The ``spec`` case runs metaloom's rows only: ``graphs``
and ``eager`` (of ``--systems``) speculating, and as the reference the same request without
speculation, graphs on ("metaloom graphs, no speculation"; graphs off where ``--systems`` has no
graphs). Its rows also report their call's ledger: forward passes (the prefill included),
tokens and milliseconds per forward, and speculating, drafted / accepted tokens, verify steps,
accepted drafts per verify step (0 .. K) and the acceptance rate; the report's ratios give
speculation's speed-up (tok/s with over without). Rows with graphs on keep the engine's graph
counters (captures, replays, static steps); on CUDA a row without replays says so in its note.

Timing: device synchronised around each call; per (shape, case) one warm-up call per system,
then ``--repeats`` rounds alternating the systems; median and min-max tokens/s (all sequences'
tokens over the call's seconds; the prompt's prefill included), and per step the median
seconds over tokens per sequence. The device's copy bandwidth (a large device-to-device copy,
bytes read + written, median of 10) is measured once; for batch-1 greedy rows, the weights one
step reads (every linear layer and the LM head, embedding lookup excluded) over the median step
time, and ``bandwidth_fraction``: that over the copy bandwidth (not for speculating rows, whose
steps emit several tokens). Each row says whether its token ids equal metaloom eager's (greedy:
the first position that differs; in the ``spec`` case eager is speculating too, so the reference
row's comparison is speculation's exactness; in bfloat16 two correct paths may part at a near
tie: reported).

Time guard: ``--budget-s`` for the whole run; before each shape and each (shape, case, system)
cell the cost is estimated (a prior from the shape and the copy bandwidth, scaled by what was
measured so far) and what does not fit is skipped with reason "time budget"; rounds stop early
when the next would not fit. ``--out`` is rewritten after every cell, so a run cut short keeps
what it measured. ``--smoke``: instead of timing, compare metaloom's token ids with
METALOOM_CUDA_GRAPHS on and off (greedy, and 4 seeded samples); exit status 1 when they differ.

The package: `cases` (what is measured: the cases and the systems), `args` (the flags, checked
into `Options`), `device` (the device, versions, copy bandwidth), `calls` (a shape built and
each system's one call), `budget` (the time guard), `baseline` (the worker process), `runner`
(shapes, cells, warm-ups and rounds), `report` (rows, comparisons, ratios, the table) and
`smoke`; here, the entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench.gpu.args import Options, add_args, options
from metaloom.bench.gpu.baseline import BaselineWorker
from metaloom.bench.gpu.budget import Budget, Estimator
from metaloom.bench.gpu.cases import CASES, DRAFTER, SYSTEMS, Case, make_cases
from metaloom.bench.gpu.device import copy_bandwidth, setup, versions
from metaloom.bench.gpu.report import format_report
from metaloom.bench.gpu.runner import Runner
from metaloom.bench.gpu.smoke import smoke

__all__ = ["HELP", "add_args", "main", "run"]

HELP = "the local engine on a GPU against transformers: random-weight Llama shapes, tokens/s and bandwidth"


def run(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The benchmark (see the module docstring); the report, also written to ``args.out``."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    start = time.monotonic()
    opts = options(args)
    budget = Budget(opts.budget_s, start)
    device, folder, vocab = setup(args)
    wanted = list(dict.fromkeys(c for s in opts.shapes for c in s.cases))
    cases = make_cases(wanted, CASES, folder, opts.seed, opts.max_tokens, opts.spec_draft)
    baseline = BaselineWorker(opts.baseline_path) if opts.baseline_path and "baseline" in opts.systems else None
    try:
        copy_gbs = copy_bandwidth(device)
        report = _header(opts, versions(device, copy_gbs), folder, vocab, cases, baseline is not None)
        say(f"{report['device']['name']}: torch {report['device']['torch']}, transformers "
            f"{report['device']['transformers']}; copy bandwidth {copy_gbs:.0f} GB/s")
        runner = Runner(opts, device, folder, vocab, budget,
                        Estimator(device.split(":")[0], copy_gbs, opts.compile_s), report, cases, args.out, say, baseline)
        for spec in opts.shapes:
            runner.run_shape(spec)
        if runner.baseline_error:
            report["baseline"]["error"] = runner.baseline_error
        report["complete"] = True
        runner.save()
        return report
    finally:
        if baseline is not None:
            baseline.close()


def _header(opts: Options, device: dict[str, Any], folder: str, vocab: int, cases: Mapping[str, Case],
            baseline: bool) -> dict[str, Any]:
    """The report before any row: the device, the options, the cases, the systems and the plan."""
    return {
        "benchmark": "gpu", "device": device, "dtype": opts.dtype, "repeats": opts.repeats,
        "warmup": 1, "budget_s": opts.budget_s, "seed": opts.seed, "tokenizer": folder, "vocab_size": vocab,
        "graphs_env": gw.GRAPHS_ENV, "graphs_env_before": os.environ.get(gw.GRAPHS_ENV),
        "cases": {c.name: {"label": c.label, "prompt_tokens": len(c.prompt_ids), "sequences": c.n,
                           "tokens_per_sequence": c.max_tokens, "expected_tokens": c.expected_tokens,
                           "temperature": c.temperature}
                  | ({"speculative": {"drafter": DRAFTER, "num_draft": c.num_draft}} if c.num_draft else {})
                  for c in cases.values()},
        "systems": {k: SYSTEMS[k] for k in opts.systems},
        "spec_draft": opts.spec_draft,
        "plan": [{"shape": s.shape, "cases": list(s.cases)} for s in opts.shapes],
        "baseline": {"path": opts.baseline_path, "cases": list(opts.baseline_cases)} if baseline else None,
        "shapes": {}, "rows": [], "complete": False}


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        result = smoke(args)
        print(json.dumps(result, indent=1) if args.json else "\n".join(
            f"{c['shape']} {c['dtype']} {c['case']}: {'equal' if c['equal'] else 'DIFFERENT'}" for c in result["checks"]))
        return 0 if result["ok"] else 1
    report = run(args)
    table = format_report(report)
    if args.json:
        print(json.dumps(report, indent=1))
        print(table, file=sys.stderr)
    else:
        print(table)
    return 0
