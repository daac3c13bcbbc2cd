"""The report's drill-down, one section per problem, as plain dicts the template lays out: the
prompt and reference, each strategy's run on it (grade, cost, chosen output, candidates), its
vote bars, and its search trees as nested nodes. Pure: the records, problems and traces come
from `metaloom.eval.report.load`.

Big sweeps stay usable: each text is cut to `TEXT_CAP` characters (less where the page's
candidates would pass `PAGE_TEXT_BUDGET`), each record shows at most `CANDIDATE_CAP`
candidates and each tree at most `TREE_NODE_CAP` nodes (the best path always), and the page
says what it cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from metaloom.eval.records import Record
from metaloom.eval.report.cells import TEXT_CAP, clip, fmt_flops, fmt_score, fmt_seconds, fmt_tokens, prompt_text, run_seconds
from metaloom.eval.report.load import TraceTrees, mapping
from metaloom.eval.report.views import correct_answers, vote_bars
from metaloom.present.numbers import finite, fmt_compact
from metaloom.present.text import one_line
from metaloom.present.tree import header
from metaloom.search.trace import NODE_KEYS, state_counts

# characters of candidate text in the whole page: a sweep with more candidates than fit at
# TEXT_CAP each gets a smaller cap for each (never below MIN_TEXT_CAP), so the page still opens
PAGE_TEXT_BUDGET = 20_000_000
MIN_TEXT_CAP = 200
CANDIDATE_CAP = 64  # candidates shown per record
TREE_NODE_CAP = 1000  # nodes shown per tree (breadth first), the best path always


# --------------------------------------------------------------------------------- trees


def node_label(node: Mapping[str, Any]) -> dict[str, Any]:
    """A node's summary line: id, state, finish, scores, tokens, round, any other numeric
    field (MCTS visits and value, a particle's weight), and its step text on one line."""
    fields = []
    if finite(node.get("score")):
        fields.append(f"score {fmt_score(node['score'])}")
    if finite(node.get("step_score")):
        fields.append(f"step {fmt_score(node['step_score'])}")
    if finite(node.get("tokens")) and (node.get("parent") is not None or node.get("tokens")):
        fields.append(f"{fmt_compact(node['tokens'])} tok")
    if node.get("round") is not None:
        fields.append(f"round {node['round']}")
    for key in ("visits", "value"):
        if finite(node.get(key)):
            fields.append(f"{key} {fmt_compact(node[key])}")
    fields += [f"{k} {fmt_compact(v)}" for k, v in node.items() if k not in NODE_KEYS and finite(v)]
    finish = node.get("finish")
    return {"id": node.get("id"), "state": str(node.get("state") or "?"),
            "finish": finish if finish not in (None, "step") else None, "fields": " · ".join(fields),
            "preview": one_line(node.get("text"), 90) if node.get("parent") is not None else "the prompt",
            "text": clip(node.get("text"))}


def tree_items(tree: Mapping[str, Any], cap: int = TREE_NODE_CAP) -> tuple[list[dict[str, Any]], int]:
    """The tree as a flat list of ``{"open": node, ...}`` / ``{"close": True}`` items, depth
    first (the template opens a `<details>` per open and closes it per close: nesting with
    no recursion, so a deep tree neither hits Python's nor jinja's limits). Shows the first
    ``cap`` nodes breadth first and the best path; returns how many nodes it left out."""
    nodes = {n["id"]: n for n in tree["nodes"]}
    children: dict[int, list[int]] = {i: [] for i in nodes}
    roots: list[int] = []
    for i, n in nodes.items():
        (roots if n.get("parent") is None else children[n["parent"]]).append(i)
    best_path: set[int] = set()
    at = tree.get("best")
    while at is not None:
        best_path.add(at)
        at = nodes[at].get("parent")
    order = list(roots)
    for i in order:  # breadth first: extends while iterating
        order.extend(children[i])
    keep = set(order[:cap]) | best_path
    items: list[dict[str, Any]] = []
    stack: list[tuple[bool, int]] = [(True, r) for r in reversed(roots) if r in keep]
    while stack:
        opening, i = stack.pop()
        if not opening:
            items.append({"close": True})
            continue
        shown = [c for c in children[i] if c in keep]
        items.append({"close": False, "open": node_label(nodes[i]), "best": i in best_path, "is_best": i == tree.get("best"),
                      "children": len(children[i]), "hidden": len(children[i]) - len(shown)})
        stack.append((False, i))
        stack.extend((True, c) for c in reversed(shown))
    return items, len(nodes) - len(keep)


def _ids(ids: Any, shown: int = 12) -> str:
    """Node ids as "#2 #4", the first ``shown`` of them and how many more."""
    if not isinstance(ids, list):
        return "?"
    return " ".join(f"#{i}" for i in ids[:shown]) + (f" +{len(ids) - shown}" if len(ids) > shown else "")


def rounds_rows(tree: Mapping[str, Any]) -> list[dict[str, str]]:
    """Each round: the nodes it expanded, the children it made, what it cost."""
    out = []
    for k, r in enumerate(tree.get("rounds") or ()):
        if not isinstance(r, Mapping):
            continue
        usage = mapping(r.get("usage"))
        out.append({"round": str(r.get("round", k)), "expanded": _ids(r.get("expanded")),
                    "children": str(len(r["children"]) if isinstance(r.get("children"), list) else r.get("children", "?")),
                    "output_tokens": fmt_tokens(usage.get("output_tokens")), "flops": fmt_flops(usage.get("flops")),
                    "scorer_calls": fmt_tokens(usage.get("scorer_calls"))})
    return out


def tree_view(tree: Mapping[str, Any], anchor: str) -> dict[str, Any]:
    """One search tree: `metaloom.present.tree.header`'s two lines, node counts, rounds, nested nodes."""
    items, omitted = tree_items(tree)
    return {"anchor": anchor, "header": header(tree).plain.splitlines(), "items": items, "omitted": omitted,
            "nodes": len(tree["nodes"]), "counts": state_counts(tree), "rounds": rounds_rows(tree),
            "strategy": str(tree.get("strategy") or "tree search"), "stop": tree.get("stop"), "best": tree.get("best")}


# ---------------------------------------------------------------------------- drill-down


def candidate_text_cap(records: Iterable[Record]) -> int:
    """Characters shown of each candidate's text: `TEXT_CAP`, or less where the candidates
    shown would pass `PAGE_TEXT_BUDGET` at that (`MIN_TEXT_CAP` at least)."""
    shown = sum(min(len(r.candidates), CANDIDATE_CAP) for r in records)
    if shown * TEXT_CAP <= PAGE_TEXT_BUDGET:
        return TEXT_CAP
    return max(MIN_TEXT_CAP, PAGE_TEXT_BUDGET // shown)


def candidate_view(c: Any, index: int, text_cap: int = TEXT_CAP) -> dict[str, Any]:
    return {"index": index, "answer": c.answer, "correct": c.correct, "score": fmt_score(c.score),
            "tokens": fmt_tokens(c.tokens), "flops": fmt_flops(c.flops), "seconds": fmt_seconds(c.seconds),
            "text": clip(c.text, text_cap)}


def record_view(r: Record, traces: Mapping[str, TraceTrees], anchor: str, text_cap: int = TEXT_CAP) -> dict[str, Any]:
    """One strategy's run on one problem: its grade and cost, the chosen output, its
    candidates (the first `CANDIDATE_CAP`), and its search trees (``traces``: the trace files
    read, by name: `metaloom.eval.report.load.read_traces`)."""
    trees, note = traces.get(r.trace, ([], None)) if r.trace else ([], None)
    return {
        "strategy": r.strategy, "answer": r.answer, "correct": r.correct, "score": fmt_score(r.score),
        "output_tokens": fmt_tokens(r.usage.get("output_tokens")), "flops": fmt_flops(r.usage.get("flops")),
        "seconds": fmt_seconds(run_seconds(r)), "stopped": r.stopped_reason, "error": r.error, "best": clip(r.best),
        "candidates": [candidate_view(c, k, text_cap) for k, c in enumerate(r.candidates[:CANDIDATE_CAP])],
        "candidates_total": len(r.candidates), "selection": r.selection.kind if r.selection else None,
        "trees": [tree_view(t, f"{anchor}-t{k}") for k, t in enumerate(trees)], "trace_note": note, "trace": r.trace,
        "anchor": anchor,
    }


def problem_views(problems: Sequence[str], strategies: Sequence[str], by_problem: Mapping[str, Mapping[str, Record]],
                  info: Mapping[str, Mapping[str, Any]], votes: Mapping[str, Any], traces: Mapping[str, TraceTrees],
                  text_cap: int = TEXT_CAP) -> list[dict[str, Any]]:
    """One drill-down per problem: prompt, reference, each strategy's run, the vote bars."""
    out = []
    for k, pid in enumerate(problems):
        recs = by_problem.get(pid, {})
        ordered = [recs[s] for s in strategies if s in recs] + [r for s, r in recs.items() if s not in strategies]
        right, wrong = correct_answers(ordered)
        problem_votes = votes.get(pid) or {}
        known = info.get(pid, {})
        out.append({
            "id": pid, "anchor": f"p{k}", "prompt": clip(prompt_text(known.get("prompt")), 4 * TEXT_CAP)
            if known.get("prompt") is not None else None, "reference": known.get("reference"),
            "correct": sum(r.correct for r in ordered), "runs": len(ordered),
            "records": [record_view(r, traces, f"p{k}-s{j}", text_cap) for j, r in enumerate(ordered)],
            "votes": [{"strategy": s, **vote_bars(problem_votes[s], right, wrong)}
                      for s in [*(s for s in strategies if s in problem_votes),
                                *(s for s in problem_votes if s not in strategies)]],
        })
    return out
