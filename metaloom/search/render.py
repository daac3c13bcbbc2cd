"""Render a search tree for the terminal: the ``{"kind": "tree"}`` event a tree-search strategy
puts in `Result.trace` (see `metaloom.search.tree.Tree.to_dict`) in, rich renderables or plain
text out. Pure: no model, no I/O beyond parsing the text it is given; `metaloom tree` is the
command around it.

Input: a whole ``metaloom run --json`` object, a bare tree event, a trace (the JSON list of
events a result carries, as `metaloom eval` writes to ``DIR/traces/``), or JSON Lines of
objects (`parse_trees`). Output: a header (strategy, aggregation, stop reason, node counts by state,
tokens), the tree (one line per node: id, state, score, step score, tokens, round, MCTS visits
and value, other numeric fields, the step's text on one line) with the best node and its
ancestors marked ★ and bold, and a table of the rounds' usage (`render`, `render_text`).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Span, Text

from metaloom.errors import InvalidParameter

STATES = ("root", "expanded", "finished", "pruned", "open")  # the order the header counts them
STATE_STYLES = {"root": "bold", "expanded": "", "finished": "green", "pruned": "red", "open": "yellow"}
# the fields every node has; any other numeric field (MCTS visits/value, a particle's weight)
# is shown as "name value"
NODE_KEYS = frozenset({"id", "parent", "depth", "text", "tokens", "step_score", "score", "state", "finish",
                       "round", "visits", "value"})
# the rounds table's usage columns (key, heading); other non-zero usage figures get a column too
USAGE_COLUMNS = (("output_tokens", "output tokens"), ("forward_passes", "forward passes"), ("flops", "FLOPs"),
                 ("seconds", "seconds"), ("scorer_calls", "scorer calls"))
UNKNOWN = "?"  # a figure the run could not count (null in the JSON)
NEWLINE = "⏎"
BEST = "★"
ELLIPSIS = "…"
_PREFIXES = ("", "k", "M", "G", "T", "P", "E", "Z", "Y")


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


@dataclass
class _Index:
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
    _index(tree, source, where)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _index(tree: Mapping[str, Any], source: str, where: str = "") -> _Index:
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
    return _Index(nodes, children, roots, depth, size, best, best_path)


# ---------------------------------------------------------------------------- formatting


def one_line(text: Any, width: int) -> str:
    """``text`` on one line: newlines as ⏎, tabs as spaces, other control characters as �; cut
    to ``width`` characters (the last one …)."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    text = text[: 2 * width + 2]  # enough to fill width even where \r\n becomes one character
    text = text.replace("\r\n", NEWLINE).replace("\n", NEWLINE).replace("\r", NEWLINE).replace("\t", " ")
    if not text.isprintable():
        text = "".join(c if c.isprintable() else "\ufffd" for c in text)
    if len(text) > width:
        return text[: width - 1] + ELLIPSIS if width > 0 else ""
    return text


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def fmt_score(v: Any) -> str:
    """A score to 3 decimals; anything else as it is."""
    return f"{v:.3f}" if _finite(v) else _clean(v)


def fmt_compact(v: Any) -> str:
    """An integer as it is, a float to 3 significant figures."""
    if _is_int(v):
        return str(v)
    return f"{v:.3g}" if _finite(v) else _clean(v)


def fmt_count(v: Any) -> str:
    return f"{v:,}" if _is_int(v) else fmt_compact(v)


def fmt_flops(v: Any) -> str:
    """FLOPs in engineering units: 1.2e9 -> "1.2 GFLOP"."""
    if not _finite(v):
        return _clean(v)
    if v == 0:
        return "0 FLOP"
    exp = min(max(math.floor(math.log10(abs(v)) / 3), 0), len(_PREFIXES) - 1)
    mantissa = float(f"{v / 1000 ** exp:.3g}")
    if abs(mantissa) >= 1000 and exp < len(_PREFIXES) - 1:  # 999.7e9 rounds to 1e3 G: say 1 T
        exp += 1
        mantissa = float(f"{v / 1000 ** exp:.3g}")
    return f"{mantissa:g} {_PREFIXES[exp]}FLOP"


def fmt_seconds(v: Any) -> str:
    return f"{v:.2f}" if _finite(v) else _clean(v)


_USAGE_FORMAT = {"flops": fmt_flops, "seconds": fmt_seconds}


def fmt_usage(key: str, v: Any, estimated: bool = False) -> str:
    """One usage figure: "?" where it is unknown (null), "~" before an estimate."""
    if v is None:
        return UNKNOWN
    return ("~" if estimated else "") + _USAGE_FORMAT.get(key, fmt_count)(v)


Part = tuple[str, str]  # text, style ("" for none)


def _clean(value: Any) -> str:
    """``value`` as text with no character that could move the cursor or colour the terminal."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else "\ufffd" for c in text)


def _label_parts(node: Mapping[str, Any], width: int, best: bool) -> tuple[list[Part], str]:
    """A node's label as styled pieces, and the style of the whole label."""
    state = _clean(node.get("state") or "?")
    parts: list[Part] = []
    if best:
        parts.append((BEST + " ", "yellow"))
    parts += [(f"#{_clean(node.get('id'))}", "cyan"), (" ", ""), (state, STATE_STYLES.get(state, "magenta"))]
    finish = node.get("finish")
    if finish is not None and finish != "step":
        parts.append((f" ({_clean(finish)})", ""))
    fields: list[str] = []
    if node.get("score") is not None:
        fields.append(f"score {fmt_score(node['score'])}")
    if node.get("step_score") is not None:
        fields.append(f"step {fmt_score(node['step_score'])}")
    if node.get("tokens") is not None and (node.get("parent") is not None or node.get("tokens")):
        fields.append(f"{fmt_compact(node['tokens'])} tok")
    if node.get("round") is not None:
        fields.append(f"r{node['round']}")
    if node.get("visits") is not None:
        fields.append(f"visits {fmt_compact(node['visits'])}")
    if node.get("value") is not None:
        fields.append(f"value {fmt_score(node['value'])}")
    for key, v in node.items():
        if key not in NODE_KEYS and isinstance(v, int | float) and not isinstance(v, bool):
            fields.append(f"{key} {fmt_compact(v)}")
    if fields:
        parts.append(("  " + _clean("  ".join(fields)), ""))
    text = node.get("text")
    if text and width > 0:
        parts.append(("  ", ""))
        parts.append((f'"{one_line(text, width)}"', "italic" if state != "pruned" else ""))
    return parts, "bold" if best else "dim" if state == "pruned" else ""


def _cells(text: str) -> int:
    """Terminal cells ``text`` needs: its length where it is ASCII but for the marks this
    module adds (one cell each), else rich's per-character measure (CJK is two cells)."""
    if text.isascii() or text.replace(NEWLINE, "").replace(ELLIPSIS, "").replace(BEST, "").isascii():
        return len(text)
    return cell_len(text)


def _assemble(parts: Sequence[Part], label_from: int = 0, label_style: str = "") -> Text:
    """One line of text from styled pieces (one `Text`, spans set directly: far cheaper than an
    append per piece); ``label_style`` over the pieces from index ``label_from`` on."""
    plain = "".join(p for p, _ in parts)
    spans: list[Span] = []
    at = 0
    for k, (piece, style) in enumerate(parts):
        if k == label_from and label_style:
            spans.append(Span(at, len(plain), label_style))
        if style:
            spans.append(Span(at, at + len(piece), style))
        at += len(piece)
    return Text(plain, no_wrap=True, overflow="ellipsis", spans=spans)


def node_label(node: Mapping[str, Any], *, width: int = 80, best: bool = False) -> Text:
    """One node on one line: [★] #id state [(finish)] score, step score, tokens, round, MCTS
    visits and value, any other numeric field, and the step's text (`one_line`). Pruned nodes
    dim; ``best`` (on the best path): ★ and bold."""
    parts, style = _label_parts(node, width, best)
    return _assemble(parts, 0, style)


# ------------------------------------------------------------------------------ rendering


def state_counts(tree: Mapping[str, Any]) -> dict[str, int]:
    """Nodes per state, the usual states first (those with none left out)."""
    counts: dict[str, int] = {}
    for node in tree.get("nodes") or ():
        state = str(node.get("state") or "?")
        counts[state] = counts.get(state, 0) + 1
    known = {s: counts.pop(s) for s in STATES if s in counts}
    return known | dict(sorted(counts.items()))


def header(tree: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> Text:
    """Two lines: what searched and why it stopped; how many nodes of each state, their tokens."""
    index = _index(tree, "<tree>")
    first: list[str] = []
    if context and context.get("model") is not None:
        first.append(f"model {context['model']}")
    first.append(str(tree.get("strategy") or (context or {}).get("strategy") or "tree search"))
    if tree.get("aggregation") is not None:
        first.append(f"aggregation {tree['aggregation']}")
    delimiter = tree.get("delimiter")
    if delimiter:
        shown = delimiter if isinstance(delimiter, list) else [delimiter]
        first.append("delimiter " + ", ".join(f'"{one_line(d, 20)}"' for d in shown))
    first.append(f"stop {tree.get('stop') if tree.get('stop') is not None else UNKNOWN}")
    first.append(f"best #{index.best}" if index.best is not None else "best none")
    counts = state_counts(tree)
    tokens = [n.get("tokens") for n in index.nodes.values()]
    known = [t for t in tokens if _finite(t)]
    total = fmt_count(sum(known)) + ("+?" if len(known) < len(tokens) and any(t is not None for t in tokens) else "")
    second = (f"{len(index.nodes)} nodes: " + ", ".join(f"{n} {s}" for s, n in counts.items())
              + f" · {total} tokens · depth {max(index.depth.values())}")
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(_clean(" · ".join(first)), style="bold")
    out.append("\n" + _clean(second))
    if tree.get("delimiter_seen") is False and len(index.nodes) > 1:
        said = ", ".join(f'"{one_line(d, 20)}"' for d in (delimiter if isinstance(delimiter, list) else [delimiter])) \
            if delimiter else "?"
        out.append("\n" + _clean(NO_DELIMITER.format(said)), style="bold yellow")
    return out


# a search whose steps never ended on the delimiter searched over step-token-limit fragments
NO_DELIMITER = ("warning: no step ended with the delimiter {}: each step ran to the step token limit "
                "(--strategy.delimiter, or --strategy.step_tokens)")


GUIDES = ("├── ", "└── ", "│   ", "    ")  # rich's own tree guides: fork, last, continue, space


@dataclass(frozen=True)
class _Line:
    parts: list[Part]  # the guides first, then the label's pieces
    style: str  # over the label
    cells: int  # terminal cells the line needs


class TreeLines:
    """The drawn tree as a rich renderable: one line per node (or note), written as segments
    straight out, so printing costs one pass over the text; a line wider than the console is
    cut with … (only such lines go through `Text`). Measures as its widest line."""

    def __init__(self, lines: list[_Line]) -> None:
        self.lines = lines
        self.widest = max((line.cells for line in lines), default=0)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        styles: dict[tuple[str, str], Style] = {}
        width = options.max_width
        newline = Segment.line()
        for line in self.lines:
            if line.cells > width:
                text = _assemble(line.parts, 1, line.style)
                text.truncate(width, overflow="ellipsis")
                yield from text.render(console)
            else:
                for k, (piece, style) in enumerate(line.parts):
                    key = (line.style if k else "", style)
                    if key not in styles:
                        styles[key] = console.get_style(key[0]) + console.get_style(style)
                    yield Segment(piece, styles[key])
            yield newline

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(min(self.widest, 20), self.widest)


def build_tree(tree: Mapping[str, Any], *, width: int = 80, collapse_pruned: bool = False,
               max_depth: int | None = None, best_only: bool = False) -> TreeLines:
    """The nodes, one line each, drawn with rich's tree guides (├── └── │), depth first with
    children in input order; a forest (several roots) renders too. The best node and its
    ancestors are marked ★ and bold. ``width``: each step's text cut to so many characters;
    ``collapse_pruned``: each node's pruned children (and what is under them) as one line
    "… N pruned"; ``max_depth``: nothing below that depth ("… N more below" says how much);
    ``best_only``: only the best path.

    Drawn here rather than by `rich.tree.Tree`, whose rendering costs O(nodes × depth) style
    arithmetic per line (seconds for a few thousand nodes)."""
    index = _index(tree, "<tree>")
    if best_only and index.best is None:
        note = "(no best node: the search chose none)"
        return TreeLines([_Line([("", ""), (note, "dim")], "", len(note))])
    fork, last, cont, space = GUIDES
    lines: list[_Line] = []
    # (node id or a note standing for nodes not drawn, the guides of its ancestors, its connector)
    stack: list[tuple[int | Part, str, str]] = []
    roots = [r for r in index.roots if not best_only or r in index.best_path]
    stack.extend((r, "", "") for r in reversed(roots))
    while stack:
        item, prefix, connector = stack.pop()
        if isinstance(item, tuple):
            parts, style = [item], ""
        else:
            parts, style = _label_parts(index.nodes[item], width, item in index.best_path)
        guides = prefix + connector
        lines.append(_Line([(guides, "dim"), *parts], style, len(guides) + _cells("".join(p for p, _ in parts))))
        if isinstance(item, tuple):
            continue
        kids: list[int | Part] = []
        if index.children[item]:
            if max_depth is not None and index.depth[item] >= max_depth:
                kids.append((f"{ELLIPSIS} {index.size[item] - 1} more below", "dim"))
            else:
                shown = index.children[item]
                if best_only:
                    shown = [k for k in shown if k in index.best_path]
                pruned = [k for k in shown if collapse_pruned and index.nodes[k].get("state") == "pruned"
                          and k not in index.best_path]
                if pruned:
                    hidden = set(pruned)
                    shown = [k for k in shown if k not in hidden]
                kids.extend(shown)
                if pruned:
                    size = sum(index.size[k] for k in pruned)
                    more = f" ({size} nodes)" if size != len(pruned) else ""
                    kids.append((f"{ELLIPSIS} {len(pruned)} pruned{more}", "dim red"))
        below = prefix + ("" if not connector else space if connector == last else cont)
        for k in range(len(kids) - 1, -1, -1):
            stack.append((kids[k], below, last if k == len(kids) - 1 else fork))
    return TreeLines(lines)


def _ids(ids: Any) -> str:
    if not isinstance(ids, list):
        return UNKNOWN if ids is None else _clean(ids)
    shown = _clean(" ".join(f"#{i}" for i in ids[:5]))
    return shown + (f" +{len(ids) - 5}" if len(ids) > 5 else "")


def _count(v: Any) -> int | None:
    if isinstance(v, list):
        return len(v)
    return v if _is_int(v) else None


def _total(values: Sequence[Any]) -> Any:
    """The sum, or None (unknown) when any value is unknown."""
    return sum(values) if all(_finite(v) for v in values) else None


def rounds_table(tree: Mapping[str, Any]) -> Table | None:
    """The rounds: nodes expanded, children made, and the usage each cost, with a total row
    ("?" where a figure is unknown, in a round or so in the total; "~" an estimate). Beyond
    the usual five figures, a column for any other usage figure some round has non-zero.
    None without rounds."""
    rounds = [r for r in tree.get("rounds") or () if isinstance(r, dict)]
    if not rounds:
        return None
    usages = [r["usage"] if isinstance(r.get("usage"), dict) else {} for r in rounds]
    columns = dict(USAGE_COLUMNS)
    for usage in usages:
        for key, v in usage.items():
            if key not in columns and key != "estimated" and (v is None or (_finite(v) and v != 0)):
                columns[key] = key.replace("_", " ")
    estimated = [set(u.get("estimated") or ()) for u in usages]
    expanded = [_count(r.get("expanded")) for r in rounds]
    children = [_count(r.get("children")) for r in rounds]
    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=True)
    table.add_column("round", justify="right", no_wrap=True, footer="total")
    table.add_column("expanded", footer=fmt_usage("expanded", _total(expanded)))
    table.add_column("children", justify="right", no_wrap=True, footer=fmt_usage("children", _total(children)))
    for key, heading in columns.items():
        total = _total([u.get(key) for u in usages])
        table.add_column(heading, justify="right", no_wrap=True,
                         footer=fmt_usage(key, total, any(key in e for e in estimated)))
    for k, (r, usage) in enumerate(zip(rounds, usages, strict=True)):
        table.add_row(_clean(r.get("round", k)), _ids(r.get("expanded")), fmt_usage("children", children[k]),
                      *(fmt_usage(key, usage.get(key), key in estimated[k]) for key in columns))
    return table


def render(tree: Mapping[str, Any], *, context: Mapping[str, Any] | None = None, width: int = 80,
           collapse_pruned: bool = False, max_depth: int | None = None, best_only: bool = False) -> Group:
    """Header, tree and rounds table as one renderable (lines wider than the console cut
    with …; `print_records` fits a file's width to them instead)."""
    group, _ = _render(tree, context, dict(width=width, collapse_pruned=collapse_pruned, max_depth=max_depth,
                                           best_only=best_only), fit=False)
    return group


def _render(tree: Mapping[str, Any], context: Mapping[str, Any] | None, options: Mapping[str, Any],
            fit: bool) -> tuple[Group, int]:
    """The renderable and the width its widest line needs (the guides counted without rich's
    per-character measuring, which costs seconds on a deep tree)."""
    body = build_tree(tree, **options)
    head = header(tree, context)
    if fit:
        head.overflow = "ignore"
    parts: list[RenderableType] = [head, body]
    widest = max(body.widest, *(line.cell_len for line in head.split()))
    table = rounds_table(tree)
    if table is not None:
        parts.append(table)
        widest = max(widest, _MEASURE.measure(table).maximum)
    return Group(*parts), widest


_MEASURE = Console(file=io.StringIO(), width=1_000_000, force_terminal=False, color_system=None)


def print_records(console: Console, records: Sequence[TreeRecord], *, fit: bool = False, **options: Any) -> None:
    """Print each record in turn, a title line before it when it has one. ``fit``: set the
    console's width to each tree's widest line first (for a file or a pipe, where no terminal
    sets one), so nothing wraps or is cut; else lines wider than the console end in …."""
    for k, record in enumerate(records):
        if record.title is not None:
            if k:
                console.print()
            console.print(Text(f"── {record.title} ──", style="bold magenta"))
        if record.skipped is not None:
            console.print(Text(record.skipped, style="dim"))
            continue
        group, widest = _render(record.tree, record.context, options, fit)
        if fit:
            console.width = max(widest, 20)
        console.print(group, crop=not fit)


def plain_console(file: Any, width: int = 80) -> Console:
    """A console that writes plain text (no colour, no terminal codes) ``width`` wide."""
    return Console(file=file, width=width, force_terminal=False, color_system=None, highlight=False,
                   soft_wrap=False, emoji=False, markup=False)


def render_text(tree: Mapping[str, Any], *, context: Mapping[str, Any] | None = None, columns: int | None = None,
                **options: Any) -> str:
    """Plain text (no colour, no terminal codes): what `metaloom tree` writes to a file.
    ``columns``: the width to fit (longer lines cut with …); default: wide enough for all."""
    buffer = io.StringIO()
    print_records(plain_console(buffer, columns or 80), [TreeRecord(None, tree, context or {})],
                  fit=columns is None, **options)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
