"""Read the search trees in a trace: the ``{"kind": "tree"}`` event a tree-search strategy
puts in `Result.trace` (`metaloom.search.tree.Tree.to_dict`), parsed and checked into plain
data. Pure: no model, no I/O beyond parsing the text it is given. `metaloom tree` draws what
it reads with `metaloom.present.tree`; `metaloom report` nests it in HTML.

Input: a whole ``metaloom run --json`` object, a bare tree event, a trace (the JSON list of
events a result carries, as `metaloom eval` writes to ``DIR/traces/``), or JSON Lines of
objects (`parse_trees`). A tree is checked once (`check_tree`, `index_tree`): unique integer
ids, parents present, no cycle, a best node that is in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter

# the order a tree's node counts are listed in (`state_counts`); `metaloom.search.tree.STATES`
# is the order a node passes through them
STATE_ORDER = ("root", "expanded", "finished", "pruned", "open")
# the fields every node has; any other numeric field (MCTS visits/value, a particle's weight)
# is shown as "name value"
NODE_KEYS = frozenset({"id", "parent", "depth", "text", "tokens", "step_score", "score", "state", "finish",
                       "round", "visits", "value"})


# ----------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class TreeRecord:
    """One tree to render. ``title``: where it came from when the input held more than one
    ("line 3", "line 3, tree 2"); ``context``: the run result around the event ({} for a bare
    event); ``skipped``: set (and ``tree`` empty) for a JSON Lines line that holds no tree."""

    title: str | None
    tree: Mapping[str, Any]
    context: Mapping[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def _bad(source: str, problem: str) -> InvalidParameter:
    return InvalidParameter("file", source,
                            f"a metaloom run --json result, a trace, a tree event or JSON Lines of them — {problem}")


def tree_events(obj: Any) -> list[Mapping[str, Any]]:
    """The tree events in a parsed JSON value: itself if it is one, else those in its trace, or
    in it if it is a trace (a list of events: a file under `metaloom eval`'s ``traces/``)."""
    if isinstance(obj, list):
        return [e for e in obj if isinstance(e, dict) and e.get("kind") == "tree"]
    if not isinstance(obj, dict):
        return []
    if obj.get("kind") == "tree":
        return [obj]
    trace = obj.get("trace")
    if isinstance(trace, list):
        return [e for e in trace if isinstance(e, dict) and e.get("kind") == "tree"]
    return []


def _what(obj: Any) -> str:
    if isinstance(obj, dict):
        if "strategy" in obj:
            return f"no tree event in the trace of strategy {obj['strategy']!r}"
        return "no tree event: no \"kind\": \"tree\" object, no trace holding one"
    if isinstance(obj, list):
        return "a JSON list with no tree event in it (a trace holds one as an object with \"kind\": \"tree\")"
    return f"a JSON {type(obj).__name__}, not an object or a list"


def parse_trees(text: str, source: str = "<input>") -> list[TreeRecord]:
    """Every tree in ``text``: one JSON object (a run result or a tree event) or JSON Lines of
    them. Raises `InvalidParameter` naming ``source`` and the problem: not JSON, no tree, a
    malformed tree (see `check_tree`)."""
    if not text.strip():
        raise _bad(source, "the file is empty")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as exc:
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        if len(lines) < 2 or not _is_json(lines[0][1]):
            raise _bad(source, f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        return _parse_lines(lines, source)
    events = tree_events(whole)
    if not events:
        raise _bad(source, _what(whole))
    context = whole if isinstance(whole, dict) and whole is not events[0] else {}
    records = []
    for k, event in enumerate(events, 1):
        check_tree(event, source, f"tree {k} of {len(events)}" if len(events) > 1 else "")
        records.append(TreeRecord(f"tree {k} of {len(events)}" if len(events) > 1 else None, event, context))
    return records


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _parse_lines(lines: Sequence[tuple[int, str]], source: str) -> list[TreeRecord]:
    records: list[TreeRecord] = []
    found = False
    for number, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(source, f"line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
        events = tree_events(obj)
        if not events:
            if not isinstance(obj, dict):
                raise _bad(source, f"line {number} is {_what(obj)}")
            records.append(TreeRecord(f"line {number}", {}, obj, skipped=_what(obj)))
            continue
        found = True
        for k, event in enumerate(events, 1):
            where = f"line {number}" + (f", tree {k} of {len(events)}" if len(events) > 1 else "")
            check_tree(event, source, where)
            records.append(TreeRecord(where, event, obj if isinstance(obj, dict) and obj is not event else {}))
    if not found:
        raise _bad(source, f"no tree event on any of its {len(lines)} lines")
    return records


# ----------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class TreeIndex:
    """A checked tree (`index_tree`), indexed for drawing it."""

    nodes: dict[int, Mapping[str, Any]]  # id -> node, in input order
    children: dict[int, list[int]]
    roots: list[int]
    depth: dict[int, int]  # from the nearest root (0 at a root)
    size: dict[int, int]  # nodes in the subtree, itself included
    best: int | None
    best_path: set[int]  # the best node and its ancestors


def check_tree(tree: Mapping[str, Any], source: str = "<tree>", where: str = "") -> None:
    """Raise `InvalidParameter` (naming ``source``) unless ``tree`` is a renderable tree: a
    list of node objects with unique integer ids whose parents are present, no cycle, and a
    best id (when not null) that is one of them. ``where``: the tree's place in the file, put
    before the problem ("line 3")."""
    index_tree(tree, source, where)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def index_tree(tree: Mapping[str, Any], source: str = "<tree>", where: str = "") -> TreeIndex:
    """``tree`` checked (as `check_tree`) and indexed: nodes by id, children, roots, depths,
    subtree sizes, the best node and its path."""
    prefix = f"{where}: " if where else ""
    raw = tree.get("nodes")
    if not isinstance(raw, list) or not raw:
        raise _bad(source, prefix + "the tree event has no \"nodes\" list")
    nodes: dict[int, Mapping[str, Any]] = {}
    for k, node in enumerate(raw):
        if not isinstance(node, dict) or not _is_int(node.get("id")):
            raise _bad(source, prefix + f"node {k} of the tree is not an object with an integer \"id\"")
        if node["id"] in nodes:
            raise _bad(source, prefix + f"node id {node['id']} appears twice")
        nodes[node["id"]] = node
    children: dict[int, list[int]] = {i: [] for i in nodes}
    roots: list[int] = []
    for i, node in nodes.items():
        parent = node.get("parent")
        if parent is None:
            roots.append(i)
        elif not _is_int(parent) or parent not in nodes:
            raise _bad(source, prefix + f"node {i}'s parent {parent!r} is missing from the tree")
        else:
            children[parent].append(i)
    depth: dict[int, int] = {}
    order: list[int] = []
    for r in roots:
        depth[r] = 0
        order.append(r)
    at = 0
    while at < len(order):  # breadth first, so no recursion limit on deep trees
        i = order[at]
        at += 1
        for c in children[i]:
            depth[c] = depth[i] + 1
            order.append(c)
    if len(order) < len(nodes):
        stuck = sorted(i for i in nodes if i not in depth)
        shown = ", ".join(map(str, stuck[:5])) + (f", … ({len(stuck)} in all)" if len(stuck) > 5 else "")
        raise _bad(source, prefix + f"a cycle of parents: no root above node{'s' if len(stuck) > 1 else ''} {shown}")
    size = dict.fromkeys(nodes, 1)
    for i in reversed(order):
        parent = nodes[i].get("parent")
        if parent is not None:
            size[parent] += size[i]
    best = tree.get("best")
    best_path: set[int] = set()
    if best is not None:
        if not _is_int(best) or best not in nodes:
            raise _bad(source, prefix + f"the best node {best!r} is not in the tree")
        at_node: int | None = best
        while at_node is not None:
            best_path.add(at_node)
            at_node = nodes[at_node].get("parent")
    return TreeIndex(nodes, children, roots, depth, size, best, best_path)


def state_counts(tree: Mapping[str, Any]) -> dict[str, int]:
    """Nodes per state, the usual states first (those with none left out)."""
    counts: dict[str, int] = {}
    for node in tree.get("nodes") or ():
        state = str(node.get("state") or "?")
        counts[state] = counts.get(state, 0) + 1
    known = {s: counts.pop(s) for s in STATE_ORDER if s in counts}
    return known | dict(sorted(counts.items()))
