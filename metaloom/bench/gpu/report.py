"""The report of `metaloom bench gpu`: a row's figures from its timed calls (`fill`), the rows of
a case set against each other (`compare`: tokens against metaloom eager's, the engine's graph
counters), the ratios per case (`ratios`), and the table (`format_report`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench.gpu.calls import CallResult, Shape
from metaloom.bench.gpu.cases import DRAFTER, METALOOM_MODES, NO_SPECULATION, ROW_NAMES, TRANSFORMERS, Case


def join_note(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


def new_row(shape: str, case: Case, system: str) -> dict[str, Any]:
    return {"shape": shape, "case": case.name, "system": ROW_NAMES[system], "key": system,
            "expected_tokens": case.expected_tokens, "error": None, "note": None}


def fill(row: dict[str, Any], done: Sequence[CallResult], case: Case, weight_bytes: int, copy_gbs: float) -> None:
    secs = [r.seconds for r in done]
    med = statistics.median(secs)
    tokens = sum(done[-1].counts)
    row |= {"tokens": tokens, "repeats": len(done), "seconds": secs, "median_s": med, "tok_s": tokens / med,
            "tok_s_min": tokens / max(secs), "tok_s_max": tokens / min(secs), "step_ms": 1e3 * med / case.max_tokens,
            "digest": done[0].digest, "deterministic": len({r.digest for r in done}) == 1}
    if done[0].ids is not None:
        row["token_ids"] = list(done[0].ids)
    speculative = case.num_draft is not None and row["key"] in NO_SPECULATION
    if case.n == 1 and case.temperature == 0 and not speculative:  # a step per token: the weights read once a token
        gbs = weight_bytes / (med / case.max_tokens) / 1e9
        row |= {"weight_gb_s": gbs, "bandwidth_fraction": gbs / copy_gbs}
    if (u := done[0].usage) is not None:
        _fill_usage(row, u, med, speculative, case)


def _fill_usage(row: dict[str, Any], u: Any, median_s: float, speculative: bool, case: Case) -> None:
    """A speculative case's row: its call's ledger (the first timed call's; greedy calls charge
    alike) and what it gives: forward passes (the prompt's prefill included), tokens and
    milliseconds per forward, and with speculation the drafts, accepted tokens per verify step
    (0 .. K) and the acceptance rate."""
    ledger = {k: getattr(u, k) for k in ("output_tokens", "forward_passes", "drafted_tokens", "accepted_tokens",
                                         "rejected_tokens", "verify_steps")}
    row |= {"ledger": ledger, "forward_passes": u.forward_passes,
            "tokens_per_forward": u.output_tokens / u.forward_passes if u.forward_passes else None,
            "forward_ms": 1e3 * median_s / u.forward_passes if u.forward_passes else None,
            "speculation": None}
    if speculative:
        row["speculation"] = {"drafter": DRAFTER, "num_draft": case.num_draft, "accepted_per_step": u.accepted_per_step,
                              "acceptance_rate": u.acceptance_rate, "verify_steps": u.verify_steps}


def spec_note(row: Mapping[str, Any]) -> str:
    """A speculative case's row in a few words: forward passes, and accepted drafts per verify step."""
    text = f"{row['forward_passes']} forwards"
    if (sp := row.get("speculation")) and sp["accepted_per_step"] is not None:
        rate = "" if sp["acceptance_rate"] is None else f", {100 * sp['acceptance_rate']:.0f}% of drafts"
        text += f", {sp['accepted_per_step']:.2f} of K={sp['num_draft']} drafts accepted per verify step{rate}"
    elif sp:
        text += ", nothing drafted"
    return text


def compare(rows: dict[str, dict[str, Any]], case: Case, shape: Shape, graph_counts: Mapping[str, Mapping[str, int]],
            device: str) -> None:
    """Each row's tokens against metaloom eager's (transformers' samples draw other random
    numbers: compared only when greedy), and the engine's graph counters."""
    for system, counts in graph_counts.items():
        if counts and system in rows:
            rows[system]["graph_counters"] = counts  # the engine's StepGraphs counters, warm-up included
            captured = METALOOM_MODES.get(system, "").startswith("on") and device.startswith("cuda")
            if captured and rows[system].get("tok_s") and not counts.get("replays"):
                rows[system]["note"] = join_note(rows[system].get("note"), "no CUDA graph replays")
            if system == "graphs" and device.startswith("cuda") and not counts.get("triton_steps"):
                rows[system]["note"] = join_note(rows[system].get("note"), "PyTorch ops (no Triton kernels ran)")
    if "graphs" in rows and shape.gen is not None and (failed := gw.graph_failures(shape.gen)):
        rows["graphs"]["capture_failures"] = failed  # the row then ran the static step uncaptured
    eager = rows.get("eager", {})
    for system, row in rows.items():
        comparable = system in ("graphs", "baseline") or case.temperature == 0
        if comparable and eager.get("digest") and row.get("digest") and system != "eager":
            row["same_tokens_as_eager"] = row["digest"] == eager["digest"]
            if case.n == 1 and row.get("token_ids") and eager.get("token_ids"):
                a, b = row["token_ids"], eager["token_ids"]
                row["first_difference"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def ratios(report: dict[str, Any], shape: str) -> None:
    """Per case of ``shape``: metaloom graphs over the best transformers row, over the graphs
    without Triton's kernels, over metaloom eager and over the baseline (tokens/s ratios)."""
    out: dict[str, Any] = {}
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in report["rows"]:
        if row["shape"] == shape and row.get("tok_s"):
            by_case.setdefault(row["case"], {})[row["key"]] = row
    for case, rows in by_case.items():
        r: dict[str, Any] = {}
        graphs = rows.get("graphs")
        best = max((rows[k] for k in TRANSFORMERS if k in rows), key=lambda x: x["tok_s"], default=None)
        if best is not None:
            r["best_transformers"] = best["system"]
        if graphs is not None:
            if best is not None:
                r["graphs_vs_best_transformers"] = graphs["tok_s"] / best["tok_s"]
            for key in ("graphs-torch", "graphs-mixed", "eager", "baseline"):
                if key in rows:
                    r[f"graphs_vs_{key}"] = graphs["tok_s"] / rows[key]["tok_s"]
        for key, plain in NO_SPECULATION.items():  # the speculative case: speculation's speed-up
            if key in rows and plain in rows:
                r[f"{key}_speculation_speedup"] = rows[key]["tok_s"] / rows[plain]["tok_s"]
        out[case] = r
    report["shapes"].setdefault(shape, {})["ratios"] = out


def format_report(report: dict[str, Any]) -> str:
    d = report["device"]
    lines = [f"{d['name']} ({d['device']}): torch {d['torch']}, transformers {d['transformers']}; copy bandwidth "
             f"{d['copy_bandwidth_gb_s']:.0f} GB/s; {report['dtype']}; median (min-max) tok/s of up to {report['repeats']} "
             f"alternating rounds after a warm-up; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget"
             + ("" if report["complete"] else " (INCOMPLETE)")]
    lines += [f"  {name}: {c['label']}" for name, c in report["cases"].items()]
    width = max([19] + [len(row["system"]) for row in report["rows"]])
    lines.append(f"{'shape':<5} {'case':<6} {'system':<{width}} {'tok/s':>9} {'(min-max)':>17} {'step ms':>8} {'bw':>5}  note")
    for row in report["rows"]:
        head = f"{row['shape']:<5} {row['case']:<6} {row['system']:<{width}}"
        if row.get("error"):
            lines.append(f"{head} {'-':>9} {'':>17} {'':>8} {'':>5}  {row['error']}")
            continue
        span = f"({row['tok_s_min']:.0f}-{row['tok_s_max']:.0f})"
        bw = f"{100 * row['bandwidth_fraction']:.0f}%" if row.get("bandwidth_fraction") is not None else ""
        notes = [row["note"]] if row.get("note") else []
        if row.get("forward_passes") is not None:
            notes.append(spec_note(row))
        if row.get("same_tokens_as_eager") is False:
            notes.append("tokens differ from eager" + (f" at {row['first_difference']}" if row.get("first_difference")
                                                        is not None else ""))
        if row.get("compile_warmup_s"):
            notes.append(f"compile warm-up {row['compile_warmup_s']:.0f} s")
        lines.append(f"{head} {row['tok_s']:9.1f} {span:>17} {row['step_ms']:8.2f} {bw:>5}  {'; '.join(notes)}")
    for shape, info in report["shapes"].items():
        parts = []
        for case, r in info.get("ratios", {}).items():
            if "graphs_vs_best_transformers" in r:
                parts.append(f"{case} {r['graphs_vs_best_transformers']:.2f}x {r['best_transformers']}")
        if parts:
            lines.append(f"{shape}: metaloom graphs vs the best transformers row: " + ", ".join(parts))
        for case, r in info.get("ratios", {}).items():
            speedups = [f"{key} {r[f'{key}_speculation_speedup']:.2f}x" for key in NO_SPECULATION
                        if f"{key}_speculation_speedup" in r]
            if speedups:
                lines.append(f"{shape} {case}: speculation vs none (tok/s), metaloom " + ", ".join(speedups))
    if (b := report.get("baseline")) and b.get("error"):
        lines.append(f"baseline: {b['error']}")
    return "\n".join(lines)
