"""`metaloom bench gpu` on the CPU: the tiny random-weight shape through every system but the
baseline (which needs an older copy of the package), the report's structure, exact token
counts, the time budget and the typed errors. The GPU itself is measured by scripts/gpu_bench.sh."""

from __future__ import annotations

import json

import pytest

from metaloom.bench.gpu import runner
from metaloom.bench.gpu.args import ShapeRun, options, parse_shapes
from metaloom.cli import build_parser, main
from metaloom.errors import InvalidParameter

ARGS = ["bench", "gpu", "--device", "cpu", "--shapes", "tiny", "--repeats", "1", "--json", "--max-tokens", "2",
        "--dtype", "float32"]


def parse(*extra: str):
    return build_parser().parse_args([*ARGS, *extra])


def test_tiny_shape_every_system_generates_exactly_the_tokens_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "gpu.json"
    # a budget no shared machine runs out of: rows skipped for time are the next test's subject
    args = parse("--out", str(out), "--static-cases", "greedy", "--budget-s", "5000")
    assert args.run(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert json.loads(out.read_text()) == report
    assert "metaloom graphs vs the best transformers row" in captured.err  # the table, printed last
    assert report["complete"] and report["device"]["name"] == "cpu" and report["device"]["copy_bandwidth_gb_s"] > 0
    assert {k: (c["sequences"], c["tokens_per_sequence"]) for k, c in report["cases"].items()} == {
        "greedy": (1, 2), "s16": (16, 2), "s64": (64, 2)}
    tiny = report["shapes"]["tiny"]
    assert tiny["config"]["hidden_size"] == 64 and tiny["config"]["vocab_size"] == report["vocab_size"] == 49152
    assert tiny["parameters"] > 0 and tiny["step_weight_bytes"] > 0
    rows = {(r["case"], r["key"]): r for r in report["rows"]}
    assert set(rows) == {(c, s) for c in ("greedy", "s16", "s64")
                         for s in ("graphs", "graphs-torch", "eager", "tf-eager")} | {
        ("greedy", "tf-static")}  # --static-cases greedy; no --baseline-path: no baseline rows
    for (case, _), row in rows.items():
        assert row["error"] is None, row
        expected = report["cases"][case]["expected_tokens"]
        assert row["tokens"] == row["expected_tokens"] == expected
        assert row["repeats"] == 1 and row["tok_s"] > 0 and row["tok_s_min"] <= row["tok_s"] <= row["tok_s_max"]
        assert row["step_ms"] > 0 and row["deterministic"]
        assert (row.get("bandwidth_fraction") is not None) == (case == "greedy")
    assert rows[("greedy", "tf-static")]["compiled"] is False  # transformers compiles on CUDA only
    assert len(rows[("greedy", "eager")]["token_ids"]) == 2
    assert "same_tokens_as_eager" in rows[("s64", "graphs")] and "same_tokens_as_eager" not in rows[("s64", "tf-eager")]
    ratios = tiny["ratios"]["s64"]
    assert ratios["best_transformers"] == "transformers eager"
    assert ratios["graphs_vs_best_transformers"] > 0 and ratios["graphs_vs_eager"] > 0


def test_what_does_not_fit_the_budget_is_skipped_with_its_reason(capsys):
    args = parse("--budget-s", "0.001", "--shapes", "tiny:greedy")
    assert args.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] and "tiny" not in report["shapes"]  # never built
    assert [r["key"] for r in report["rows"]] == ["graphs", "graphs-torch", "eager", "tf-eager", "tf-static"]
    assert all(r["error"].startswith("time budget") for r in report["rows"])


def test_smoke_compares_graphs_on_and_off(capsys):
    args = parse("--smoke")
    status = args.run(args)
    report = json.loads(capsys.readouterr().out)
    assert [(c["dtype"], c["case"]) for c in report["checks"]] == [
        ("float32", "greedy"), ("float32", "s4"), ("bfloat16", "greedy"), ("bfloat16", "s4")]
    for check in report["checks"]:
        assert check["shape"] == "tiny" and set(check["runs"]) == {"on", "off", "on again"}
        assert check["max_logprob_difference"] is not None
    assert "transformers_equal" in report["checks"][0]
    assert report["ok_means"] == "equal in float32"
    assert status == (0 if report["ok"] else 1)


def test_bad_arguments_are_typed_errors(capsys):
    with pytest.raises(InvalidParameter, match="shapes"):
        options(parse("--shapes", "tiny,70b"))
    with pytest.raises(InvalidParameter, match="shapes"):
        options(parse("--shapes", "tiny:greedy+s32"))
    with pytest.raises(InvalidParameter, match="systems"):
        options(parse("--systems", "graphs,vllm"))
    with pytest.raises(InvalidParameter, match="baseline_path"):
        options(parse("--baseline-path", "/nonexistent"))
    assert main([*ARGS, "--shapes", "70b"]) == 2  # the CLI: one error line, exit status 2
    assert "invalid shapes='70b'" in capsys.readouterr().err


def test_shapes_parse_in_order_with_their_cases():
    assert parse_shapes("1b,7b:greedy+s16,135m", ["greedy", "s64"]) == [
        ShapeRun("1b", ("greedy", "s64")), ShapeRun("7b", ("greedy", "s16")), ShapeRun("135m", ("greedy", "s64"))]


def test_a_failing_compilation_is_the_rows_note_and_the_row_is_measured_without_it(capsys, monkeypatch):
    from metaloom.bench import gpu_worker

    real = gpu_worker.transformers_call
    compiled = []

    def call(model, case, device, static=False, compile=True):
        compiled.append(static and compile)
        if static and compile:
            raise RuntimeError("inductor: no working C compiler\nmore lines")
        return real(model, case, device, static=static, compile=compile)

    monkeypatch.setattr(runner, "transformers_compiles", lambda device: True)  # as on CUDA
    monkeypatch.setattr(gpu_worker, "transformers_call", call)
    args = parse("--shapes", "tiny:greedy", "--systems", "eager,tf-static")
    assert args.run(args) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    static = rows["tf-static"]
    assert static["error"] is None and static["tokens"] == 2 and static["compiled"] is False
    assert static["note"] == ("torch.compile failed (RuntimeError: inductor: no working C compiler); measured without "
                              "compiling; timed after the other rows, not alternated with them")
    assert compiled == [True, False, False]  # the compiling warm-up, the warm-up without, one timed round


def test_a_compilation_that_does_not_fit_is_skipped(capsys, monkeypatch):
    monkeypatch.setattr(runner, "transformers_compiles", lambda device: True)
    args = parse("--shapes", "tiny:greedy", "--systems", "eager,tf-static", "--compile-s", "100000")
    assert args.run(args) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["eager"]["error"] is None
    assert rows["tf-static"]["error"].startswith("time budget: compiling takes ~100000 s")


def test_spec_case_speculates_with_graphs_on_and_off_and_reports_acceptance(capsys):
    """The spec case (named only: not a default case): metaloom's rows speculating with the
    n-gram drafter, graphs on (the uncaptured static step on the CPU) and off, and graphs on
    without speculation as the reference; exact token counts, the ledger's acceptance figures,
    and in float32 the same tokens on every path."""
    assert "spec" not in parse().cases.split(",")  # the default runs are unchanged
    k = 3
    args = parse("--shapes", "tiny:spec", "--systems", "graphs,eager,tf-eager", "--max-tokens", "24",
                 "--spec-draft", str(k))
    assert args.run(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["complete"] and report["spec_draft"] == k
    case = report["cases"]["spec"]
    assert case["speculative"] == {"drafter": "ngram", "num_draft": k} and case["expected_tokens"] == 24
    rows = {r["key"]: r for r in report["rows"]}
    assert list(rows) == ["graphs", "eager", "graphs-nospec"]  # metaloom only; transformers does not run it
    assert rows["graphs-nospec"]["system"] == "metaloom graphs, no speculation"
    for key, row in rows.items():
        assert row["error"] is None, row
        assert row["tokens"] == 24 and len(row["token_ids"]) == 24 and row["tok_s"] > 0
        ledger = row["ledger"]
        assert ledger["output_tokens"] == 24 and row["forward_passes"] == ledger["forward_passes"] > 0
        assert row["tokens_per_forward"] == 24 / row["forward_passes"] and row["forward_ms"] > 0
        if key == "graphs-nospec":
            assert row["speculation"] is None and ledger["verify_steps"] == 0 and row["forward_passes"] == 24
            assert row["bandwidth_fraction"] is not None  # a step per token
            continue
        sp = row["speculation"]
        assert sp["drafter"] == "ngram" and sp["num_draft"] == k and "bandwidth_fraction" not in row
        assert ledger["verify_steps"] == sp["verify_steps"] > 0 and ledger["forward_passes"] == 1 + ledger["verify_steps"]
        assert 0 <= sp["accepted_per_step"] <= k
        assert ledger["accepted_tokens"] + ledger["rejected_tokens"] == ledger["drafted_tokens"] <= k * ledger["verify_steps"]
        assert ledger["verify_steps"] + ledger["accepted_tokens"] == 24 - 1  # the prefill's token, then one + accepted a step
        assert (sp["acceptance_rate"] is None) == (ledger["drafted_tokens"] == 0)
    assert rows["graphs"]["ledger"] == rows["eager"]["ledger"]
    # METALOOM_CUDA_GRAPHS=on: the verify forwards take the static step (uncaptured here); off: never
    assert rows["graphs"]["graph_counters"]["steps"] > 0 and rows["graphs"]["graph_counters"]["replays"] == 0
    assert rows["eager"]["graph_counters"]["steps"] == 0
    # float32: graphs and eager speculating, and plain greedy, give the same tokens
    assert rows["graphs"]["same_tokens_as_eager"] and rows["graphs-nospec"]["same_tokens_as_eager"]
    assert rows["graphs"]["token_ids"] == rows["eager"]["token_ids"] == rows["graphs-nospec"]["token_ids"]
    speedup = report["shapes"]["tiny"]["ratios"]["spec"]["graphs_speculation_speedup"]
    assert speedup == rows["graphs"]["tok_s"] / rows["graphs-nospec"]["tok_s"]
    assert "speculation vs none" in captured.err and "drafts accepted per verify step" in captured.err
    with pytest.raises(InvalidParameter, match="spec_draft"):
        options(parse("--spec-draft", "16"))


def test_the_mixed_row_runs_only_where_it_differs_from_graphs(capsys, monkeypatch):
    from metaloom.models.engine import graphs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(graphs, "TRITON_ROWS", 32)
    args = parse("--systems", "graphs,graphs-mixed", "--shapes", "tiny:s16+s64")
    assert args.run(args) == 0
    rows = {(r["case"], r["key"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert "the same step as graphs at 16 rows" in rows[("s16", "graphs-mixed")]["error"]
    mixed = rows[("s64", "graphs-mixed")]
    assert mixed["error"] is None and mixed["tokens"] == mixed["expected_tokens"] == 128
