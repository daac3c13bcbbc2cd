"""`metaloom tree`: the search tree of a tree-search result drawn in the terminal
(`metaloom.commands.tree`, `metaloom.search.trace`, `metaloom.present.tree`)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from metaloom.cli import main
from metaloom.present.numbers import fmt_flops
from metaloom.present.tree import render_text


def node(id, parent, depth, text, tokens, score, state, finish, round, **extra):
    return {"id": id, "parent": parent, "depth": depth, "text": text, "tokens": tokens, "step_score": score,
            "score": score, "state": state, "finish": finish, "round": round, **extra}


LONG = "Let me add them all up first:\n6 + 4 + 3 + 2 = 15, and then see what is left to reach the target 24.\n\n"


def tree_event():
    """11 nodes, every state; #4 the best; #2 pruned with a pruned subtree of its own."""
    nodes = [
        {"id": 0, "parent": None, "depth": 0, "text": "", "tokens": 0, "step_score": None, "score": None,
         "state": "root", "finish": None, "round": None},
        node(1, 0, 1, "6 * 4 = 24\n\n", 9, 0.91, "expanded", "step", 0, visits=4, value=0.625),
        node(2, 0, 1, LONG, 31, 0.2, "pruned", "step", 0),
        node(3, 0, 1, "4 - 3 = 1\n\n", 7, 0.5549, "expanded", "step", 0),
        node(4, 1, 2, "24 * 1 = 24. The answer is 24.", 12, 0.95, "finished", "eos", 1, visits=2, value=0.9),
        node(5, 1, 2, "24 - 1 = 23\n\n", 8, 0.1, "pruned", "step", 1),
        node(6, 1, 2, "24 + 1 = 25\n\n", 8, 0.12, "pruned", "step", 1),
        node(7, 2, 2, "15 + 9\n\n", 6, 0.3, "pruned", "step", 1),
        node(8, 7, 3, "= 24", 5, 0.31, "pruned", "eos", 2),
        node(9, 3, 2, "[bold]1 * 6[/bold]", 4, 0.4, "open", "step", 1, weight=0.25),
        node(10, 3, 2, "x" * 30, 200, 0.3, "finished", "length", 1),
    ]
    usage = {"output_tokens": 46, "forward_passes": 17, "flops": 1.2e9, "seconds": 0.4, "scorer_calls": 1}
    return {
        "kind": "tree", "strategy": "step_beam_search", "aggregation": "last", "delimiter": ["\n\n"],
        "best": 4, "stop": "finished",
        "rounds": [
            {"round": 0, "expanded": [0], "children": 3, "usage": usage},
            {"round": 1, "expanded": [1, 2, 3], "children": 6,
             "usage": {"output_tokens": 251, "forward_passes": None, "flops": 3.456e12, "seconds": 1.234,
                       "scorer_calls": 2, "estimated": ["flops"]}},
            {"round": 2, "expanded": [7], "children": 1,
             "usage": {"output_tokens": 5, "forward_passes": 3, "flops": 2.5e6, "seconds": 0.05, "scorer_calls": 1}},
        ],
        "nodes": nodes,
    }


def run_result(tree=None):
    return {"model": "smollm2-135m", "strategy": "step_beam_search", "best": 0, "answer": "24",
            "candidates": ["..."], "scores": [0.95], "usage": {"output_tokens": 302},
            "trace": [{"kind": "step", "round": 0}, tree or tree_event(), {"kind": "done"}],
            "stopped_reason": "finished"}


def write(tmp_path, obj, name="result.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


def tree_cli(capsys, *argv):
    """Exit status and stdout's lines (trailing spaces dropped)."""
    status = main(["tree", *argv])
    out, err = capsys.readouterr()
    assert err == ""
    return status, [line.rstrip() for line in out.splitlines()]


HEADER = [
    'model smollm2-135m · step_beam_search · aggregation last · delimiter "⏎⏎" · stop finished · best #4',
    "11 nodes: 1 root, 2 expanded, 2 finished, 5 pruned, 1 open · 290 tokens · depth 3",
]
TREE = [
    "★ #0 root",
    '├── ★ #1 expanded  score 0.910  step 0.910  9 tok  r0  visits 4  value 0.625  "6 * 4 = 24⏎⏎"',
    '│   ├── ★ #4 finished (eos)  score 0.950  step 0.950  12 tok  r1  visits 2  value 0.900  '
    '"24 * 1 = 24. The answer is 24."',
    '│   ├── #5 pruned  score 0.100  step 0.100  8 tok  r1  "24 - 1 = 23⏎⏎"',
    '│   └── #6 pruned  score 0.120  step 0.120  8 tok  r1  "24 + 1 = 25⏎⏎"',
    '├── #2 pruned  score 0.200  step 0.200  31 tok  r0  '
    '"Let me add them all up first:⏎6 + 4 + 3 + 2 = 15, and then see what is left to …"',
    '│   └── #7 pruned  score 0.300  step 0.300  6 tok  r1  "15 + 9⏎⏎"',
    '│       └── #8 pruned (eos)  score 0.310  step 0.310  5 tok  r2  "= 24"',
    '└── #3 expanded  score 0.555  step 0.555  7 tok  r0  "4 - 3 = 1⏎⏎"',
    '    ├── #9 open  score 0.400  step 0.400  4 tok  r1  weight 0.25  "[bold]1 * 6[/bold]"',
    '    └── #10 finished (length)  score 0.300  step 0.300  200 tok  r1  "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"',
]
ROUNDS = [
    "round   expanded   children   output tokens   forward passes         FLOPs   seconds   scorer calls",
    "─" * 99,
    "    0   #0                3              46               17     1.2 GFLOP      0.40              1",
    "    1   #1 #2 #3          6             251                ?   ~3.46 TFLOP      1.23              2",
    "    2   #7                1               5                3     2.5 MFLOP      0.05              1",
    "─" * 99,
    "total   5                10             302                ?   ~3.46 TFLOP      1.68              4",
]


def test_run_result_renders_header_tree_and_rounds(tmp_path, capsys):
    status, lines = tree_cli(capsys, write(tmp_path, run_result()))
    assert status == 0
    assert lines == HEADER + TREE + ROUNDS


def test_best_path_is_starred_and_nothing_else(tmp_path, capsys):
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()))
    starred = [line for line in lines if "★" in line]
    assert [line.split("★ ")[1].split()[0] for line in starred] == ["#0", "#1", "#4"]
    _, lines = tree_cli(capsys, write(tmp_path, {**tree_event(), "best": 10}))
    assert [line.split("★ ")[1].split()[0] for line in lines if "★" in line] == ["#0", "#3", "#10"]
    assert "best #10" in lines[0]


def test_best_only_keeps_only_the_best_path(tmp_path, capsys):
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--best-only")
    assert lines[2:5] == [TREE[0], TREE[1].replace("├──", "└──"), TREE[2].replace("│   ├──", "    └──")]
    assert lines[5] == ROUNDS[0]  # then the rounds table: no other node
    _, lines = tree_cli(capsys, write(tmp_path, {**tree_event(), "best": None, "stop": "budget"}), "--best-only")
    assert lines[0].endswith("stop budget · best none")
    assert lines[2] == "(no best node: the search chose none)"


def test_collapse_pruned_counts_the_hidden_nodes(tmp_path, capsys):
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--collapse-pruned")
    assert lines[2:10] == [
        TREE[0], TREE[1], TREE[2],
        "│   └── … 2 pruned",  # #5 and #6
        TREE[8].replace("└──", "├──"),
        TREE[9].replace("    ├──", "│   ├──"),
        TREE[10].replace("    └──", "│   └──"),
        "└── … 1 pruned (3 nodes)",  # #2 and the pruned #7, #8 under it
    ]
    assert lines[10] == ROUNDS[0]  # no other node line
    assert not any(f"#{i} " in line for line in lines[2:10] for i in (2, 5, 6, 7, 8))
    # a pruned node on the best path stays
    _, lines = tree_cli(capsys, write(tmp_path, {**tree_event(), "best": 8}), "--collapse-pruned")
    assert [line.split("★ ")[1].split()[0] for line in lines if "★" in line] == ["#0", "#2", "#7", "#8"]
    assert "│   └── … 2 pruned" in lines


def test_width_cuts_text_and_shows_newlines(tmp_path, capsys):
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--width", "12")
    assert lines[7] == '├── #2 pruned  score 0.200  step 0.200  31 tok  r0  "Let me add …"'
    assert lines[3] == '├── ★ #1 expanded  score 0.910  step 0.910  9 tok  r0  visits 4  value 0.625  "6 * 4 = 24⏎⏎"'
    assert lines[12] == '    └── #10 finished (length)  score 0.300  step 0.300  200 tok  r1  "xxxxxxxxxxx…"'
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--width", "0")
    assert lines[7] == "├── #2 pruned  score 0.200  step 0.200  31 tok  r0"
    assert not any('"' in line for line in lines[2:13])


def test_control_characters_and_markup_are_shown_literally(tmp_path, capsys):
    tree = tree_event()
    tree["nodes"][9]["text"] = "a\tb\r\nc\x1b[31md"
    _, lines = tree_cli(capsys, write(tmp_path, tree))
    assert lines[11] == '    ├── #9 open  score 0.400  step 0.400  4 tok  r1  weight 0.25  "a b⏎c\ufffd[31md"'
    assert TREE[9].endswith('"[bold]1 * 6[/bold]"')  # rich markup in a step is text, not style


def test_max_depth_says_how_much_is_below(tmp_path, capsys):
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--max-depth", "1")
    assert lines[2:11] == [TREE[0], TREE[1], "│   └── … 3 more below", TREE[5], "│   └── … 2 more below", TREE[8],
                           "    └── … 2 more below", ROUNDS[0], ROUNDS[1]]
    _, lines = tree_cli(capsys, write(tmp_path, tree_event()), "--max-depth", "0")
    assert lines[2:4] == [TREE[0], "└── … 10 more below"]


def test_mcts_visits_values_and_other_numbers(tmp_path, capsys):
    tree = tree_event()
    tree["strategy"] = "mcts"
    tree["nodes"][0].update(visits=7, value=0.5, prior=1, note="text is not shown", flag=True)
    _, lines = tree_cli(capsys, write(tmp_path, tree))
    assert lines[0].startswith("mcts · aggregation last")
    assert lines[2] == "★ #0 root  visits 7  value 0.500  prior 1"
    assert "visits 2  value 0.900" in lines[4]
    assert "weight 0.25" in lines[11]


def test_rounds_table_unknown_and_estimated_figures(tmp_path, capsys):
    tree = tree_event()
    tree["rounds"][0]["usage"]["seconds"] = None
    tree["rounds"][2]["usage"]["input_tokens"] = 1200  # a non-zero figure beyond the five: its own column
    tree["rounds"][2]["usage"]["drafted_tokens"] = 0  # zero: no column
    _, lines = tree_cli(capsys, write(tmp_path, tree))
    table = lines[13:]
    assert table[0].split("   ")[-1].strip() == "input tokens"
    assert "drafted" not in table[0]
    assert table[2].split() == ["0", "#0", "3", "46", "17", "1.2", "GFLOP", "?", "1", "?"]
    assert table[4].split() == ["2", "#7", "1", "5", "3", "2.5", "MFLOP", "0.05", "1", "1,200"]
    assert table[6].split() == ["total", "5", "10", "302", "?", "~3.46", "TFLOP", "?", "4", "?"]


def test_no_rounds_no_table(tmp_path, capsys):
    tree = tree_event()
    del tree["rounds"]
    _, lines = tree_cli(capsys, write(tmp_path, tree))
    assert lines == HEADER[0].split(" · ", 1)[1:] + HEADER[1:] + TREE


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 FLOP"), (950, "950 FLOP"), (1.2e9, "1.2 GFLOP"), (3.456e12, "3.46 TFLOP"), (12_345, "12.3 kFLOP"),
    (999.7e9, "1 TFLOP"), (None, "None")])
def test_flops_in_engineering_units(value, text):
    assert fmt_flops(value) == text


def test_json_lines_render_each_line_under_its_number(tmp_path, capsys):
    other = {**tree_event(), "best": 10, "strategy": "mcts"}
    text = "\n".join([json.dumps(run_result()), json.dumps({"strategy": "best_of_n", "trace": []}), "",
                      json.dumps(other)]) + "\n"
    status, lines = tree_cli(capsys, write(tmp_path, text, "results.jsonl"))
    assert status == 0
    first = 2 + len(HEADER) + len(TREE) + len(ROUNDS)
    assert lines[:first] == ["── line 1 ──", *HEADER, *TREE, *ROUNDS, ""]
    assert lines[first:first + 3] == ["── line 2 ──", "no tree event in the trace of strategy 'best_of_n'", ""]
    assert lines[first + 3] == "── line 4 ──"
    assert lines[first + 4].startswith("mcts · aggregation last") and lines[first + 4].endswith("best #10")


def test_stdin_and_bare_event_render_the_same_tree(tmp_path, capsys, monkeypatch):
    _, from_file = tree_cli(capsys, write(tmp_path, tree_event()))
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(run_result())))
    status, from_stdin = tree_cli(capsys, "-")
    assert status == 0
    assert from_file[2:] == from_stdin[2:] == TREE + ROUNDS
    assert from_file[:2] == [HEADER[0].removeprefix("model smollm2-135m · "), HEADER[1]]


def test_eval_trace_file_renders_its_tree(tmp_path, capsys):
    # `metaloom eval` writes a search's trace (the result's list of events) to DIR/traces/
    status, lines = tree_cli(capsys, write(tmp_path, run_result()["trace"]))
    assert status == 0
    assert lines[2:] == TREE + ROUNDS
    assert lines[:2] == [HEADER[0].removeprefix("model smollm2-135m · "), HEADER[1]]


def test_several_trees_in_one_trace(tmp_path, capsys):
    result = run_result()
    result["trace"].append({**tree_event(), "strategy": "second"})
    _, lines = tree_cli(capsys, write(tmp_path, result))
    assert lines[0] == "── tree 1 of 2 ──"
    assert lines[1:3] == HEADER
    assert "── tree 2 of 2 ──" in lines
    assert lines[lines.index("── tree 2 of 2 ──") + 1].startswith("model smollm2-135m · second ·")


def bad(tree_changes=None, node_changes=None):
    tree = tree_event()
    tree.update(tree_changes or {})
    for index, changes in (node_changes or {}).items():
        tree["nodes"][index].update(changes)
    return json.dumps(run_result(tree))


@pytest.mark.parametrize(("content", "problem"), [
    ("", "the file is empty"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    (json.dumps({"strategy": "best_of_n", "trace": [{"kind": "vote"}]}),
     "no tree event in the trace of strategy 'best_of_n'"),
    (json.dumps({"answer": 3}), 'no tree event: no "kind": "tree" object, no trace holding one'),
    ("[1, 2]", "a JSON list with no tree event in it"),
    (json.dumps([{"kind": "vote"}]), "a JSON list with no tree event in it"),
    ("3", "a JSON int, not an object or a list"),
    (bad(node_changes={5: {"parent": 42}}), "node 5's parent 42 is missing from the tree"),
    (bad({"best": None}, node_changes={0: {"parent": 1}}),
     "a cycle of parents: no root above nodes 0, 1, 2, 3, 4, … (11 in all)"),
    (bad(node_changes={8: {"parent": 8}}), "a cycle of parents: no root above node 8"),
    (bad(node_changes={3: {"id": 1}}), "node id 1 appears twice"),
    (bad(node_changes={3: {"id": "3"}}), 'node 3 of the tree is not an object with an integer "id"'),
    (bad({"best": 99}), "the best node 99 is not in the tree"),
    (bad({"nodes": []}), 'the tree event has no "nodes" list'),
    (json.dumps({"answer": 1}) + "\n" + json.dumps({"answer": 2}) + "\n", "no tree event on any of its 2 lines"),
    (json.dumps(tree_event()) + "\n{oops\n", "line 2 is not JSON (Expecting property name"),
    (json.dumps(tree_event()) + "\n" + bad({"best": 99}).replace("\n", "") + "\n",
     "line 2: the best node 99 is not in the tree"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, problem):
    path = write(tmp_path, content)
    assert main(["tree", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: invalid file={path!r}")
    assert problem in err


def test_unreadable_file_and_bad_options(tmp_path, capsys):
    missing = str(tmp_path / "missing.json")
    assert main(["tree", missing]) == 2
    assert capsys.readouterr().err == f"error: invalid file={missing!r}: allowed a readable file (No such file or directory)\n"
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe{}")
    assert main(["tree", str(binary)]) == 2
    assert "byte 0 is not UTF-8" in capsys.readouterr().err
    path = write(tmp_path, tree_event())
    assert main(["tree", path, "--width", "-1"]) == 2
    assert capsys.readouterr().err == "error: invalid width=-1: allowed an integer >= 0 (0 = no step text)\n"
    assert main(["tree", path, "--max-depth", "-2"]) == 2
    assert "invalid max_depth=-2" in capsys.readouterr().err


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_colour_and_its_width(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, tree_event())
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "60")
    for flags, coloured in (([], True), (["--no-color"], False)):
        screen = FakeTerminal()
        monkeypatch.setattr(sys, "stdout", screen)
        assert main(["tree", path, *flags]) == 0
        out = screen.getvalue()
        assert ("\x1b[" in out) is coloured
        if coloured:  # finished green, pruned dim red, open yellow; the best path bold
            lines = out.splitlines()
            assert "\x1b[1;32mfinished" in lines[4] and "#4" in lines[4]
            assert "\x1b[2;31mpruned" in lines[5] and "#5" in lines[5]
            assert "\x1b[33mopen" in lines[11] and "\x1b[1" not in lines[11]
            assert "\x1b[1;33m★ " in lines[2]
        else:  # plain, cut to the terminal's 60 columns
            lines = out.splitlines()
            assert lines[3] == TREE[1][:59] + "…"
            assert max(len(line) for line in lines) <= 60


def test_a_large_tree_renders_whole():
    """3,000 nodes, every one drawn (the renderer draws guides itself, without recursion, so a
    deep tree cannot hit Python's recursion limit; its speed is not a unit test's business)."""
    nodes = [{"id": 0, "parent": None, "state": "root", "text": "", "tokens": 0}]
    for i in range(1, 3000):  # a beam-like tree, depth 60
        nodes.append({"id": i, "parent": max(0, i - 1 - (i - 1) % 50), "state": "pruned" if i % 3 else "expanded",
                      "text": "a step of reasoning\n\n" * 3, "tokens": 30, "score": i / 3000, "step_score": 0.5,
                      "round": i // 50, "finish": "step"})
    tree = {"kind": "tree", "strategy": "s", "best": 2999, "stop": "budget", "nodes": nodes,
            "rounds": [{"round": r, "expanded": [r], "children": 50, "usage": {"output_tokens": 1500}} for r in range(60)]}
    text = render_text(tree)
    assert len(text.splitlines()) == 2 + 3000 + 60 + 4


def test_a_search_that_never_saw_its_delimiter_says_so_in_the_header(tmp_path, capsys):
    """It used to be a trace event only: `metaloom tree` showed nothing."""
    _, lines = tree_cli(capsys, write(tmp_path, {**tree_event(), "delimiter_seen": False}))
    assert lines[2].startswith('warning: no step ended with the delimiter "⏎⏎"') and "step token limit" in lines[2]
    _, lines = tree_cli(capsys, write(tmp_path, {**tree_event(), "delimiter_seen": True}))
    assert not any(line.startswith("warning") for line in lines)
