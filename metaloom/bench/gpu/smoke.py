"""`metaloom bench gpu --smoke`: instead of timing, whether metaloom's token ids are the same with
CUDA graphs on and off (and on again), where they first part, and how far the chosen tokens'
log-probabilities move while they agree."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench import names
from metaloom.bench.gpu.args import options
from metaloom.bench.gpu.calls import Shape, build_shape, checked, error_text, free_shape, result_of
from metaloom.bench.gpu.cases import SMOKE_CASES, Case, make_cases
from metaloom.bench.gpu.device import setup, versions


def smoke(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """metaloom's token ids with METALOOM_CUDA_GRAPHS on and off, per ``--smoke-dtypes`` and
    shape: greedy and 4 seeded samples, each run with graphs on, off, and on again; equal or
    not, where they first differ, and the largest difference of the chosen tokens'
    log-probabilities between on and off while their tokens agree (0 when the captured steps
    compute exactly what eager ones do). ``ok``: equal in float32, where rounding cannot flip a
    token (in bfloat16 two correct paths whose kernels round differently part ways at a near
    tie: reported, not failed); all equal when float32 is not among the dtypes. Greedy also
    runs transformers once: whether its tokens equal metaloom's (information only)."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    opts = options(args)
    device, folder, vocab = setup(args)
    cases = make_cases(list(SMOKE_CASES), SMOKE_CASES, folder, opts.seed, opts.max_tokens)
    from metaloom.models.load import DTYPES

    dtypes = names("smoke_dtypes", args.smoke_dtypes, list(DTYPES))
    checks = []
    for dtype, spec in ((d, s) for d in dtypes for s in opts.shapes):
        shape = build_shape(spec.shape, vocab, device, dtype, opts.seed, folder, cases)
        try:
            for case in cases.values():
                checks.append({"dtype": dtype} | _smoke_case(shape, case, device))
                c = checks[-1]
                say(f"smoke {spec.shape} {dtype} {case.name}: graphs on/off/on {'EQUAL' if c['equal'] else 'DIFFER'}"
                    + "".join(f"; {k} {v['seconds']:.2f} s" if "seconds" in v else f"; {k} {v['error']}"
                              for k, v in c["runs"].items())
                    + (f"; first difference at token {c['first_difference']}" if c.get("first_difference") is not None
                       else "")
                    + (f"; log-probabilities differ by up to {c['max_logprob_difference']:.2g}"
                       if c.get("max_logprob_difference") is not None else "")
                    + (f"; transformers greedy {'equal' if c['transformers_equal'] else 'differs'}"
                       if "transformers_equal" in c else ""))
        finally:
            free_shape(shape, device)
    strict = [c for c in checks if c["dtype"] == "float32"] or checks
    report = {"benchmark": "gpu smoke", "device": versions(device, None), "checks": checks,
              "ok": all(c["equal"] for c in strict), "ok_means": "equal in float32" if strict is not checks else "equal"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _smoke_case(shape: Shape, case: Case, device: str) -> dict[str, Any]:
    req = shape.requests[case.name]
    runs: dict[str, dict[str, Any]] = {}
    seqs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
    for label, mode in (("on", "on"), ("off", "off"), ("on again", "on")):
        logprobs: list[list[float]] = []
        try:
            seconds, ids = gw.metaloom_call(shape.gen, req, device, mode, logprobs)
            r = checked(result_of(seconds, ids), case)
            runs[label] = {"seconds": r.seconds, "digest": r.digest}
            seqs[label] = (ids, logprobs)
        except Exception as exc:  # reported as the check's failure
            runs[label] = {"error": error_text(exc)}
    digests = {v.get("digest") for v in runs.values()}
    check: dict[str, Any] = {"shape": shape.name, "case": case.name, "label": case.label,
                             "equal": len(digests) == 1 and None not in digests, "runs": runs}
    if "on" in seqs and "off" in seqs:
        (a_ids, a_lp), (b_ids, b_lp) = seqs["on"], seqs["off"]
        firsts, diffs = [], []
        for x, y, lx, ly in zip(a_ids, b_ids, a_lp, b_lp, strict=True):
            first = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
            firsts.append(first)
            agree = len(x) if first is None else first
            diffs += [abs(p - q) for p, q in zip(lx[:agree], ly[:agree], strict=False)]
        check["first_difference"] = min((f for f in firsts if f is not None), default=None)
        check["max_logprob_difference"] = max(diffs, default=None)
        if case.n == 1:
            check["ids"] = {"on": a_ids[0], "off": b_ids[0]}
    if case.temperature == 0 and "off" in seqs:
        try:
            _, tf = gw.transformers_call(shape.model, case.spec(), device)
            check["transformers_equal"] = tf == seqs["off"][0]
            if not check["transformers_equal"]:
                check["transformers_first_difference"] = next(
                    (i for i, (p, q) in enumerate(zip(tf[0], seqs["off"][0][0], strict=False)) if p != q), None)
        except Exception as exc:  # information only
            check["transformers_error"] = error_text(exc)
    return check
