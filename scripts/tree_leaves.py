"""How well each tree search's step scorer ranks the solutions its own tree finished: the
search-side twin of `run_tables.py`'s "Scorers" table. Reads DIR/records.jsonl, DIR/traces/ and
DIR/config.json; grades every finished leaf with the sweep's own task (reasoning-gym, offline;
no model).

    .venv/bin/python scripts/tree_leaves.py runs/gsm --exclude scorer=rollout
    .venv/bin/python scripts/tree_leaves.py runs/game24

A leaf's solution is the text of its path from the root (the steps as generated, the way the
search's ``best`` is built); its score is the node's aggregated score, the one the search picks
by. Per search strategy: trees, finished leaves, the fraction correct, the trees holding both
right and wrong leaves (the only ones where the scorer can matter), the mean per-tree AUROC of
leaf scores against correctness there, and the search's own pick there against a uniformly
random finished leaf.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from metaloom.eval.analysis.curves import latest
from metaloom.eval.analysis.scorers import auroc
from metaloom.eval.records import read_records
from metaloom.eval.tasks import make_task


def path_text(nodes: Mapping[int, Mapping[str, Any]], leaf: Mapping[str, Any]) -> str:
    parts = []
    node: Mapping[str, Any] | None = leaf
    while node is not None:
        parts.append(node.get("text") or "")
        parent = node.get("parent")
        node = nodes.get(parent) if parent is not None else None
    return "".join(reversed(parts))


def leaves(trace: Sequence[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """(solution text, score) of each finished node of the trace's last tree."""
    trees = [e for e in trace if e.get("kind") == "tree"]
    if not trees:
        return []
    nodes = {n["id"]: n for n in trees[-1]["nodes"]}
    return [(path_text(nodes, n), float(n["score"])) for n in nodes.values()
            if n.get("state") == "finished" and n.get("score") is not None]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--exclude", action="append", default=[], metavar="TEXT",
                   help="leave out the strategies whose spec contains TEXT (repeatable)")
    args = p.parse_args(argv)
    with open(os.path.join(args.dir, "config.json")) as f:
        config = json.load(f)
    setup = config["setup"]
    task = make_task(setup["task"], limit=setup["limit"], seed=setup["seed"])
    problems = {q.id: q for q in task.problems()}
    rows: dict[str, dict[str, Any]] = {}
    for r in latest(list(read_records(os.path.join(args.dir, "records.jsonl")))).values():
        if r.trace is None or r.error is not None or any(t in r.strategy for t in args.exclude):
            continue
        with open(os.path.join(args.dir, r.trace)) as f:
            found = leaves(json.load(f))
        row = rows.setdefault(r.strategy, {"trees": 0, "leaves": 0, "right": 0, "aurocs": [], "picks": [],
                                           "randoms": []})
        row["trees"] += 1
        if not found:
            continue
        graded = [task.grade(problems[r.problem], text).correct for text, _ in found]
        row["leaves"] += len(found)
        row["right"] += sum(graded)
        a = auroc([s for _, s in found], graded)
        if a is not None:
            row["aurocs"].append(a)
            row["picks"].append(float(r.correct))
            row["randoms"].append(sum(graded) / len(graded))
    print("| search | trees | finished leaves | correct | mixed trees | leaf AUROC | its pick | random leaf |")
    print("|---|---|---|---|---|---|---|---|")
    for spec, row in rows.items():
        def mean(xs: list[float]) -> str:
            return f"{sum(xs) / len(xs):.2f}" if xs else "—"

        right = f"{100 * row['right'] / row['leaves']:.1f}%" if row["leaves"] else "—"
        print(f"| {spec} | {row['trees']} | {row['leaves']} | {right} | {len(row['aurocs'])} | {mean(row['aurocs'])} "
              f"| {mean(row['picks'])} | {mean(row['randoms'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
