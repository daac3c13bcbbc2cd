"""`metaloom bench decode`: the worker protocol and the alternating measurement against the
worker's fake system (it sleeps a known time; no model, no peers), the report's arithmetic,
and the arguments."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

import pytest

from metaloom.bench.decode import bandwidth, format_report, options, summarise, systems
from metaloom.bench.peers import SystemSpec, Worker, WorkerFailed, measure
from metaloom.bench.peers.worker import serve
from metaloom.cli import build_parser
from metaloom.errors import InvalidParameter

CASES = {"greedy": {"prompt_ids": [1, 2, 3], "n": 1, "max_tokens": 4, "temperature": 0.0, "seed": 0},
         "samples": {"prompt_ids": [1, 2, 3, 4], "n": 3, "max_tokens": 2, "temperature": 1.0, "seed": 0}}


def fake(name: str, **config: object) -> SystemSpec:
    return SystemSpec(name, "fake", sys.executable, {"label": name, **config})


def go(specs: list[SystemSpec], repeats: int = 3):
    return measure(specs, CASES, repeats=repeats, threads=1, settle_s=0.0, load_timeout_s=60, run_timeout_s=60)


def test_serve_answers_each_request_in_order():
    requests = io.StringIO("\n".join(json.dumps(m) for m in [
        {"op": "run", "case": "greedy"},  # before load: an error reply, not a crash
        {"op": "load", "system": "fake", "config": {}, "cases": CASES, "threads": 2},
        {"op": "run", "case": "samples"},
        {"op": "bogus"},
        {"op": "quit"},
        {"op": "run", "case": "greedy"},  # after quit: never read
    ]) + "\n")
    replies = io.StringIO()
    serve(requests, replies)
    out = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert [r["ok"] for r in out] == [False, True, True, False, True]
    assert "run before load" in out[0]["error"]
    assert out[1]["info"]["threads"] == 2
    assert out[2]["tokens"] == 6 and out[2]["seconds"] >= 0
    assert "unknown op" in out[3]["error"]


def test_systems_alternate_within_each_round_and_medians_exclude_the_warmup(tmp_path):
    log = tmp_path / "order.log"
    a = fake("A", log=str(log), seconds={"greedy": 0.05, "samples": 0.01})
    b = fake("B", log=str(log), seconds={"greedy": 0.15, "samples": 0.01})
    runs, skipped = go([a, b])
    assert skipped == {}
    # 1 warm-up + 3 timed rounds per case, A B A B ... within each
    assert log.read_text().split("\n")[:-1] == ["A greedy", "B greedy"] * 4 + ["A samples", "B samples"] * 4
    ra = runs[0]
    assert len(ra.outcomes["greedy"].seconds) == 3 and ra.outcomes["greedy"].tokens == 4
    assert ra.outcomes["samples"].tokens == 6
    rows = summarise(runs, CASES)
    ga, gb = rows[0]["results"]["greedy"], rows[1]["results"]["greedy"]
    assert 0.05 <= ga["median_s"] < 0.15 <= gb["median_s"] < 0.5  # each its own sleep, not a sum or the warm-up
    assert ga["min_s"] <= ga["median_s"] <= ga["max_s"]
    assert ga["tok_s"] == pytest.approx(4 / ga["median_s"])


def test_token_count_mismatch_is_an_error_not_a_rate():
    runs, _ = go([fake("short", tokens={"samples": 5}), fake("ok")], repeats=1)
    short = runs[0].outcomes["samples"]
    assert short.error == "generated 5 tokens, expected 6"
    assert runs[0].outcomes["greedy"].error is None  # other cases go on
    row = summarise(runs, CASES)[0]["results"]["samples"]
    assert "tok_s" not in row and row["error"] == short.error
    assert "short" in format_report(_report(runs)) and "error: generated 5 tokens, expected 6" in format_report(_report(runs))


def test_missing_venv_and_failing_load_are_skipped_with_the_reason(tmp_path):
    missing = SystemSpec("llama.cpp Q4_1", "llama.cpp", str(tmp_path / "nope" / "bin" / "python"), {})
    runs, skipped = go([missing, fake("broken", fail_load="no such kernel"), fake("ok")], repeats=1)
    assert [r.spec.name for r in runs] == ["ok"]
    assert skipped["llama.cpp Q4_1"] == f"{tmp_path / 'nope' / 'bin' / 'python'} does not exist"
    assert skipped["broken"] == "RuntimeError: no such kernel"


def test_an_import_error_in_a_peer_is_a_skip():
    runs, skipped = go([SystemSpec("vllm bfloat16", "vllm", sys.executable, {"folder": "x", "dtype": "bfloat16"},
                                   {**os.environ, "PYTHONPATH": "/nonexistent"})], repeats=1)
    assert runs == [] and skipped["vllm bfloat16"]  # ModuleNotFoundError: No module named 'vllm' (CI has no vLLM)


def test_a_worker_crashing_mid_run_is_reported_not_raised():
    # run 1: greedy warm-up, 2: greedy timed, 3: samples warm-up -> crash
    runs, skipped = go([fake("crashy", crash_on_run=3), fake("steady")], repeats=1)
    crashy, steady = runs
    assert skipped == {}
    assert len(crashy.outcomes["greedy"].seconds) == 1 and crashy.outcomes["greedy"].error is None
    assert crashy.outcomes["samples"].error.startswith("worker exited (exit status 3)")
    assert steady.outcomes["samples"].error is None and len(steady.outcomes["samples"].seconds) == 1


def test_a_crash_in_an_earlier_case_marks_the_later_ones_not_run():
    runs, _ = go([fake("crashy", crash_on_run=1)], repeats=1)
    assert runs[0].outcomes["greedy"].error.startswith("worker exited")
    assert runs[0].outcomes["samples"].error == "not run: the worker died during case 'greedy'"


def test_a_crash_while_loading_starts_the_fallback_with_a_note():
    plain = fake("llama.cpp", label="plain")
    runs, skipped = go([SystemSpec("llama.cpp", "fake", sys.executable, {"crash_on_load": True}, fallback=plain,
                                   fallback_note="extra buffers crashed")], repeats=1)
    assert skipped == {} and runs[0].info["label"] == "plain" and runs[0].spec is plain
    assert runs[0].note.startswith("extra buffers crashed: worker exited (exit status 4)")


def test_a_hung_worker_is_killed_after_the_timeout():
    w = Worker(fake("slow", seconds={"greedy": 30}), CASES, 1, 60)
    with pytest.raises(WorkerFailed) as exc:
        w.request({"op": "run", "case": "greedy"}, 0.5)
    assert exc.value.crashed and "no reply to 'run' in 0.5 s (killed)" in exc.value.reason
    assert w.proc.poll() is not None
    w.close()


def _report(runs):
    rows = summarise(runs, CASES)
    return {"model": "m", "gguf_quantisation": "Q4_1",
            "machine": {"device": "cpu", "threads": 1, "copy_bandwidth_gb_s": 10.0, "load_average_before": (0.0,),
                        "load_average_after": (0.0,)},
            "repeats": 1, "cases": {c: {"label": c} for c in CASES}, "systems": rows, "skipped": {"vllm": "no --vllm VENV"},
            "achieved_weight_bandwidth": bandwidth(rows, 1000, 10.0)}


def test_ratios_and_weight_bandwidth():
    def spec(name: str, seconds: float, **config: object) -> SystemSpec:
        return SystemSpec(name, "fake", sys.executable, {"seconds": {"greedy": seconds}, **config})

    runs, _ = go([spec("metaloom dense float32", 0.2, weights="dense"), spec("llama.cpp Q4_1", 0.1),
                  spec("metaloom native float32", 0.1, weights="native")], repeats=1)
    runs[0].info["dense_weight_bytes"] = 4000
    report = _report(runs)
    ours, llama, _native = (row["results"]["greedy"] for row in report["systems"])
    assert ours["ratios"]["metaloom_float32"] == pytest.approx(1.0)
    assert ours["ratios"]["llama.cpp"] == pytest.approx(ours["tok_s"] / llama["tok_s"])
    assert llama["ratios"]["metaloom_float32"] == pytest.approx(llama["tok_s"] / ours["tok_s"])
    assert 1.3 < llama["ratios"]["metaloom_float32"] < 3.0  # 0.1 s against 0.2 s, give or take scheduling
    bw = report["achieved_weight_bandwidth"]
    assert set(bw) == {"metaloom dense float32", "metaloom native float32"}  # not llama.cpp: no metaloom weights mode
    dense = bw["metaloom dense float32"]
    assert dense["weight_bytes_per_token"] == 4000
    assert dense["gb_s"] == pytest.approx(4000 * 4 / ours["median_s"] / 1e9)
    assert bw["metaloom native float32"]["weight_bytes_per_token"] == 1000  # the GGUF's quantised bytes
    text = format_report(report)
    assert "skipped vllm: no --vllm VENV" in text and "vs llama.cpp" in text


# ---------------------------------------------------------------- arguments


def parse(*argv: str, which: str = "decode") -> argparse.Namespace:
    return build_parser().parse_args(["bench", which, *argv])


def test_decode_defaults_keep_the_old_comparison():
    args = parse()
    assert options(args) == (["float32", "bfloat16"], ["dense"], ["transformers"])
    assert parse(which="speculative").peers == "transformers,llama.cpp"  # its own parser, its own default
    assert args.new_tokens == 128 and args.samples == 16 and args.sample_tokens == 64


def test_each_benchmark_takes_only_its_own_flags(capsys):
    assert parse("--serve-tokens", "8", which="admit").serve_tokens == 8
    assert parse("--search-n", "4", which="search").search_n == 4
    for which, foreign in (("decode", "--serve-tokens"), ("admit", "--search-n"), ("search", "--remote-n"),
                           ("serve", "--drafters"), ("fork", "--isa")):
        with pytest.raises(SystemExit):
            parse(foreign, "1", which=which)
        assert f"unrecognized arguments: {foreign}" in capsys.readouterr().err


def test_decode_arguments():
    args = parse("--peers", "llama.cpp,vllm,transformers", "--weights", "native,dense", "--llama-cpp", "/v/llama",
                 "--vllm", "/v/vllm", "--dtypes", "bfloat16")
    assert options(args) == (["bfloat16"], ["native", "dense"], ["llama.cpp", "vllm", "transformers"])
    assert args.llama_cpp == "/v/llama" and args.vllm == "/v/vllm"
    assert options(parse("--peers", ""))[2] == []  # given empty: no peers
    with pytest.raises(InvalidParameter, match="peers"):
        options(parse("--peers", "llama.cpp,ollama"))
    with pytest.raises(InvalidParameter, match="weights"):
        options(parse("--weights", "int4"))


def test_systems_from_arguments(tmp_path):
    args = parse("--peers", "llama.cpp,vllm,transformers", "--weights", "native,dense", "--llama-cpp", str(tmp_path / "l"),
                 "--dtypes", "float32,bfloat16")
    specs, skipped = systems(args, "/folder", "/m.gguf", "Q4_1", 2)
    assert [s.name for s in specs] == ["metaloom native float32", "metaloom dense float32", "metaloom dense bfloat16",
                                       "transformers float32", "transformers bfloat16", "llama.cpp Q4_1"]
    assert skipped == {"vllm": "no --vllm VENV given"}
    llama = specs[-1]
    assert llama.python == str(tmp_path / "l" / "bin" / "python") and llama.config["extra_buffers"] is True
    assert llama.fallback is not None and llama.fallback.config["extra_buffers"] is False
    assert specs[0].config["weights"] == "native" and specs[1].config["weights"] == "dense"
    specs, skipped = systems(parse("--peers", "llama.cpp,vllm", "--vllm", str(tmp_path / "v")), "/folder", None, "", 2)
    assert "not a GGUF" in skipped["llama.cpp"]
    vllm = specs[-1]
    assert vllm.name == "vllm bfloat16" and vllm.python == str(tmp_path / "v" / "bin" / "python")
    assert vllm.env is not None and vllm.env["VLLM_TARGET_DEVICE"] == "cpu" and vllm.env["HF_HUB_OFFLINE"] == "1"


def test_kernel_paths_give_a_row_each_with_the_path_forced_and_the_libraries_capped(tmp_path):
    from metaloom.errors import UnsupportedISA
    from metaloom.models.kernels import isa

    paths = isa.runnable()
    args = parse("--peers", "llama.cpp", "--weights", "native", "--dtypes", "float32", "--isa", ",".join(paths),
                 "--llama-cpp", str(tmp_path / "l"), "--llama-cpp-avx2", str(tmp_path / "l2"))
    specs, _ = systems(args, "/folder", "/m.gguf", "Q4_1", 2)
    ours = [s for s in specs if s.system == "metaloom"]
    assert [s.name for s in ours] == [f"metaloom native float32 [{p}]" for p in paths]
    for spec, path in zip(ours, paths, strict=True):
        assert spec.env is not None and spec.env[isa.ENV] == path
        assert all(spec.env[k] == v for k, v in isa.library_env(path).items())
    llama = [s for s in specs if s.system == "llama.cpp"]
    assert [s.name for s in llama] == ["llama.cpp Q4_1", "llama.cpp Q4_1 [avx2 build]"]
    assert llama[1].python == str(tmp_path / "l2" / "bin" / "python")
    with pytest.raises(InvalidParameter, match="isa"):
        systems(parse("--isa", "sse9"), "/folder", None, "", 2)
    lacking = next(name for name in isa.NAMES if name not in paths)
    with pytest.raises(UnsupportedISA, match=lacking):
        systems(parse("--isa", lacking), "/folder", None, "", 2)


def test_native_weight_bytes_are_the_linear_layers_and_head_as_stored(tmp_path):
    import gguf
    import numpy as np

    from metaloom.bench.decode import gguf_weight_bytes

    path = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), dtype=np.float32))  # 64 bytes
    w.add_tensor("blk.0.attn_norm.weight", np.ones(4, dtype=np.float32))  # not a linear layer
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float16))  # the tied head: 64 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_weight_bytes(path) == (128, "Q4_1")
    f32, f16 = int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16)
    assert gguf_weight_bytes(path, frozenset({f32, f16}))[0] == 128
    assert gguf_weight_bytes(path, frozenset({f32}))[0] == 64 + 8 * 4 * 4  # F16 not kept: dequantised to float32


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_idle_workers_are_stopped_while_another_is_timed(tmp_path):
    log, pids = tmp_path / "states.log", tmp_path / "pids"
    pids.mkdir()
    go([fake(name, log=str(log), pid_dir=str(pids)) for name in ("A", "B", "C")], repeats=1)
    lines = log.read_text().splitlines()
    assert len(lines) == 12
    assert lines[0] == "A greedy B:T C:T" and lines[1] == "B greedy A:T C:T" and lines[-1] == "C samples A:T B:T"
    assert all(line.count(":T") == 2 for line in lines)


def test_single_weights_for_one_model_benchmarks():
    """Benchmarks that load one model take one --weights value; a list is decode's alone."""
    import argparse

    from metaloom.bench import single_weights
    from metaloom.errors import InvalidParameter

    assert single_weights(argparse.Namespace(weights="native")) == "native"
    assert single_weights(argparse.Namespace(weights="dense")) == "dense"
    with pytest.raises(InvalidParameter, match="weights"):
        single_weights(argparse.Namespace(weights="native,dense"))


def test_native_q8_is_a_row_of_native_weights_with_int8_activations():
    args = parse("--peers", "", "--weights", "native,native-q8", "--dtypes", "float32")
    specs, _ = systems(args, "/folder", "/m.gguf", "Q4_1", 2)
    assert [s.name for s in specs] == ["metaloom native float32", "metaloom native-q8 float32"]
    assert "activations" not in specs[0].config
    assert specs[1].config["weights"] == "native" and specs[1].config["activations"] == "q8"


def test_the_worker_loads_what_the_row_says_int8_activations_included():
    """The row's label must say what ran: the q8 row's model multiplies int8 activations."""
    from metaloom.bench.peers.worker import MetaloomSystem

    case = {"prompt_ids": [1, 2, 3], "temperature": 0.0, "n": 1, "max_tokens": 2}
    q8 = MetaloomSystem({"model": "default", "dtype": "float32", "weights": "native", "activations": "q8"},
                        {"greedy": case}, 1)
    assert q8.info["activations"] == "q8" and q8.gen.loaded.activations == "q8"
    plain = MetaloomSystem({"model": "default", "dtype": "float32", "weights": "native"}, {"greedy": case}, 1)
    assert plain.info["activations"] == "float" and plain.gen.loaded.activations == "float"
