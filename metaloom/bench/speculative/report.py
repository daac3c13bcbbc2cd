"""One dtype's table of `metaloom bench speculative`: per method its tokens, tok/s (medians over
the repeats), speedup over plain greedy (end to end, and for metaloom's methods decode only: after
each prompt's prefill and first token), acceptance rate, accepted tokens per verification
step and tokens per target forward; the best drafter's ratios to the peers; and what the
cost model chose."""

from __future__ import annotations

import statistics
from typing import Any

from metaloom.bench.speculative.methods import Method
from metaloom.models import LoadedModel


def run_report(loaded: LoadedModel, methods: list[Method], skipped: dict[str, str], dtype: str,
               first: Method | None = None) -> dict[str, Any]:
    """One dtype's report of the measured ``methods`` (the first is plain greedy, the baseline).
    ``first``: greedy stopped at one token (each prompt's prefill and first token); metaloom's
    rows then also carry their decode-only rate, every token after the first over the time after
    that, and its ratio to greedy's (speculation speeds up decoding, never the prefill)."""
    plain = methods[0]
    rows = []
    head = None if first is None or not first.times else {i: statistics.median(t) for i, t in first.times.items()}
    for m in methods:
        seconds = sum(statistics.median(t) for t in m.times.values())
        tokens = sum(len(t) for t in m.tokens.values())
        row: dict[str, Any] = {"method": m.name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
        if head is not None and not m.peer and all(i in head for i in m.times):
            after = sum(max(statistics.median(t) - head[i], 1e-9) for i, t in m.times.items())
            row["decode_tok_s"] = sum(len(t) - 1 for t in m.tokens.values()) / after
        if not m.peer:
            row["same_tokens_as_greedy"] = all(m.tokens[i] == plain.tokens[i] for i in m.tokens)
            usage = [ledger.usage for ledger in m.ledgers.values()]
            drafted = sum(u.drafted_tokens for u in usage)
            accepted = sum(u.accepted_tokens for u in usage)
            steps = sum(u.verify_steps for u in usage)
            row["acceptance_rate"] = accepted / drafted if drafted else None
            row["accepted_per_step"] = accepted / steps if steps else None
            # target forwards: the prefill (first token) plus one per verification step
            row["tokens_per_forward"] = tokens / (steps + len(usage)) if steps else (1.0 if m is plain else None)
            if m.choices:
                row["cost_model"] = _choices(m.choices)
        rows.append(row)
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base
        if "decode_tok_s" in row and "decode_tok_s" in rows[0]:
            row["decode_speedup"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    ours = [r for r in rows[1:] if "acceptance_rate" in r]
    best = max(ours, key=lambda r: r["tok_s"]) if ours else None
    ratios: dict[str, float] = {}
    if best is not None:
        for r in rows:
            if r["method"].startswith(("transformers", "llama.cpp")):
                ratios[f"{best['method']} / {r['method']}"] = best["tok_s"] / r["tok_s"]
    costs = [m.planned.cost.to_dict() for m in methods if m.planned is not None and m.planned.cost is not None]
    return {"model": loaded.name, "dtype": dtype, "weights": loaded.weights, "methods": rows,
            "first_token_s": None if head is None else sum(head.values()),
            "verify_cost": costs[0] if costs else None,
            "best_drafter": best and best["method"],
            "ratios": ratios, "skipped": skipped}


def _choices(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What the cost model chose over a method's prompts (its last timed call of each): nodes
    verified per row-step, per drafter the steps it drafted, the nodes verified and kept, and the
    steps its exploration budget held from drafting and the nodes it cut."""
    nodes: dict[str, int] = {}
    drafters: dict[str, dict[str, int]] = {}
    steps = 0
    for report in reports.values():
        steps += report["steps"]
        for k, v in report["nodes_verified"].items():
            nodes[k] = nodes.get(k, 0) + v
        for name, d in report["drafters"].items():
            total = drafters.setdefault(name, {"steps": 0, "verified": 0, "kept": 0})
            for key in total:
                total[key] += d[key]
    first = next(iter(reports.values()))
    budget = {key: sum(r["budget"][key] for r in reports.values()) for key in ("held_steps", "trimmed_nodes")}
    return {"steps": steps, "nodes_verified": dict(sorted(nodes.items(), key=lambda kv: int(kv[0]))),
            "drafters": drafters, "budget": budget, "scale": first["scale"],
            "per_prompt": [reports[i] for i in sorted(reports)]}
