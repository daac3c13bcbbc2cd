"""The table of `metaloom bench remote`: a row per (system, strategy), then the usage check and
what was skipped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metaloom.bench.remote.systems import OPTILLM_APPROACH


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(result: Mapping[str, Any]) -> str:
    o = result["options"]
    lines = [f"{result['model']} ({result['dtype']}): {result['problems_run']} of {o['problems']} reasoning-gym "
             f"{o['task']} problems ('{o['preset']}', seed {o['seed']}), n={o['n']}, temperature {o['temperature']}, "
             f"max_tokens {o['max_tokens']}, one pass in {result['wall_s']:.0f} s",
             f"load average at start {' '.join(f'{v:.2f}' for v in result['loadavg_start'])}, "
             f"at end {' '.join(f'{v:.2f}' for v in result['loadavg_end'])} ({result['cpus']} CPUs)",
             f"{'system':16s} {'strategy':16s} {'acc':>5s} {'per-sample':>10s} {'prompt tok':>10s} {'output tok':>10s} "
             f"{'s/problem median (min-max)':>27s} {'total s':>8s} {'errors':>6s}"]
    for r in result["rows"]:
        label = r["strategy"] if r["system"] != "optillm" else OPTILLM_APPROACH.get(r["strategy"], r["strategy"])
        prompt = r["input_tokens"] if r["input_tokens"] is not None else (r["server"] or {}).get("prompt")
        mark = "" if r["input_tokens"] is not None or prompt is None else "*"
        spread = f"{_f(r['seconds_median'], 1)} ({_f(r['seconds_min'], 1)}-{_f(r['seconds_max'], 1)})"
        lines.append(f"{r['system']:16s} {label:16s} {r['accuracy']:5.2f} {_f(r['sample_accuracy']):>10s} "
                     f"{_n(prompt) + mark:>10s} {_n(r['output_tokens']):>10s} {spread:>27s} {r['seconds_total']:8.1f} "
                     f"{r['errors']:6d}")
    if any(r["system"] == "optillm" and r["input_tokens"] is None for r in result["rows"]):
        lines.append("* optillm reports no prompt tokens: the server's count")
    checked = [r for r in result["rows"] if r["usage_check"]]
    if checked:
        lines.append("usage check, summed over the runs: charged by the system (metaloom: ledger; optillm: its "
                     "completion_tokens) / counted by vLLM (/metrics) [runs that differ]")
        lines.append(f"{'system':16s} {'strategy':16s} {'output tokens':>24s} {'prompt tokens':>30s} {'cached tokens':>22s}")
        for r in checked:
            cells = []
            for name in ("output_tokens", "input_tokens", "cached_tokens"):
                c = r["usage_check"].get(name)
                fan = f" +{c['fanout']:,}" if c is not None and c["fanout"] else ""
                cells.append("-" if c is None else f"{c['charged']:,}{fan} / {c['server']:,} [{c['runs_differing']}/{c['runs']}]")
            label = r["strategy"] if r["system"] != "optillm" else OPTILLM_APPROACH.get(r["strategy"], r["strategy"])
            lines.append(f"{r['system']:16s} {label:16s} {cells[0]:>24s} {cells[1]:>30s} {cells[2]:>22s}")
        if any(r["usage_check"].get("input_tokens", {}).get("fanout") for r in checked):
            lines.append("prompt +N: vLLM runs a request for n samples as n requests and counts each one's prompt; "
                         "its usage (the ledger's source) counts it once: N = (n - 1) x the sampling prompts")
        lines.append("vLLM's request counter over those runs: " + ", ".join(
            f"{r['system']} {r['strategy']} {r['server']['requests']:,}" for r in checked if r["server"]))
    for r in result["rows"]:
        if r["first_error"]:
            lines.append(f"{r['system']} {r['strategy']}: first error: {r['first_error']}")
    for name, why in result["skipped"].items():
        lines.append(f"{name} skipped: {why}")
    return "\n".join(lines)
