"""Draw a search tree for the terminal: a tree event (checked by `metaloom.search.trace`) in,
rich renderables or plain text out. Pure: no model, no I/O; `metaloom tree` is the command
around it.

Output: a header (strategy, aggregation, stop reason, node counts by state, tokens), the tree
(one line per node: id, state, score, step score, tokens, round, MCTS visits and value, other
numeric fields, the step's text on one line) with the best node and its ancestors marked ★
and bold, and a table of the rounds' usage (`render`, `render_text`, `print_records`).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Span, Text

from metaloom.ledger import PEAKS
from metaloom.present.numbers import UNKNOWN, finite, fmt_compact, fmt_count, fmt_score, fmt_usage, is_int
from metaloom.present.text import ELLIPSIS, NEWLINE, clean, one_line
from metaloom.search.trace import NODE_KEYS, TreeRecord, index_tree, state_counts

STATE_STYLES = {"root": "bold", "expanded": "", "finished": "green", "pruned": "red", "open": "yellow"}
# the rounds table's usage columns (key, heading); other non-zero usage figures get a column too
USAGE_COLUMNS = (("output_tokens", "output tokens"), ("forward_passes", "forward passes"), ("flops", "FLOPs"),
                 ("seconds", "seconds"), ("scorer_calls", "scorer calls"))
BEST = "★"


# ---------------------------------------------------------------------------------- labels


Part = tuple[str, str]  # text, style ("" for none)


def _label_parts(node: Mapping[str, Any], width: int, best: bool) -> tuple[list[Part], str]:
    """A node's label as styled pieces, and the style of the whole label."""
    state = clean(node.get("state") or "?")
    parts: list[Part] = []
    if best:
        parts.append((BEST + " ", "yellow"))
    parts += [(f"#{clean(node.get('id'))}", "cyan"), (" ", ""), (state, STATE_STYLES.get(state, "magenta"))]
    finish = node.get("finish")
    if finish is not None and finish != "step":
        parts.append((f" ({clean(finish)})", ""))
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
        parts.append(("  " + clean("  ".join(fields)), ""))
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


def header(tree: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> Text:
    """Two lines: what searched and why it stopped; how many nodes of each state, their tokens."""
    index = index_tree(tree, "<tree>")
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
    known = [t for t in tokens if finite(t)]
    total = fmt_count(sum(known)) + ("+?" if len(known) < len(tokens) and any(t is not None for t in tokens) else "")
    second = (f"{len(index.nodes)} nodes: " + ", ".join(f"{n} {s}" for s, n in counts.items())
              + f" · {total} tokens · depth {max(index.depth.values())}")
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(clean(" · ".join(first)), style="bold")
    out.append("\n" + clean(second))
    if tree.get("delimiter_seen") is False and len(index.nodes) > 1:
        said = ", ".join(f'"{one_line(d, 20)}"' for d in (delimiter if isinstance(delimiter, list) else [delimiter])) \
            if delimiter else "?"
        out.append("\n" + clean(NO_DELIMITER.format(said)), style="bold yellow")
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
    index = index_tree(tree, "<tree>")
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
        return UNKNOWN if ids is None else clean(ids)
    shown = clean(" ".join(f"#{i}" for i in ids[:5]))
    return shown + (f" +{len(ids) - 5}" if len(ids) > 5 else "")


def _count(v: Any) -> int | None:
    if isinstance(v, list):
        return len(v)
    return v if is_int(v) else None


def _total(values: Sequence[Any]) -> Any:
    """The sum, or None (unknown) when any value is unknown."""
    return sum(values) if all(finite(v) for v in values) else None


def _highest(values: Sequence[Any]) -> Any:
    """A peak's total: the highest known value, or None when none is known. A round's peak is
    unknown where it stayed under an earlier one (`metaloom.ledger.Usage.since`), so the
    highest known is the run's peak over its rounds."""
    known = [v for v in values if finite(v)]
    return max(known) if known else None


def rounds_table(tree: Mapping[str, Any]) -> Table | None:
    """The rounds: nodes expanded, children made, and the usage each cost, with a total row
    ("?" where a figure is unknown, in a round or so in the total; "~" an estimate; a peak's
    total is its highest round, not a sum). Beyond
    the usual five figures, a column for any other usage figure some round has non-zero.
    None without rounds."""
    rounds = [r for r in tree.get("rounds") or () if isinstance(r, dict)]
    if not rounds:
        return None
    usages = [r["usage"] if isinstance(r.get("usage"), dict) else {} for r in rounds]
    columns = dict(USAGE_COLUMNS)
    for usage in usages:
        for key, v in usage.items():
            if key not in columns and key != "estimated" and (v is None or (finite(v) and v != 0)):
                columns[key] = key.replace("_", " ")
    estimated = [set(u.get("estimated") or ()) for u in usages]
    expanded = [_count(r.get("expanded")) for r in rounds]
    children = [_count(r.get("children")) for r in rounds]
    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=True)
    table.add_column("round", justify="right", no_wrap=True, footer="total")
    table.add_column("expanded", footer=fmt_usage("expanded", _total(expanded)))
    table.add_column("children", justify="right", no_wrap=True, footer=fmt_usage("children", _total(children)))
    for key, heading in columns.items():
        total = (_highest if key in PEAKS else _total)([u.get(key) for u in usages])
        table.add_column(heading, justify="right", no_wrap=True,
                         footer=fmt_usage(key, total, any(key in e for e in estimated)))
    for k, (r, usage) in enumerate(zip(rounds, usages, strict=True)):
        table.add_row(clean(r.get("round", k)), _ids(r.get("expanded")), fmt_usage("children", children[k]),
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
