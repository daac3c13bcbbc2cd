"""`metaloom bench serve`: its pure pieces against hand-made vectors, and the client loop, server
lifecycle and A/B orchestration against a tiny fake OpenAI-compatible streaming server (no model).

Run as a script (``python tests/test_bench_serve.py PORT MODE``) this file is that fake server,
so the lifecycle tests can start it as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from metaloom.bench.serve import (
    LevelRow,
    RequestTiming,
    format_table,
    median_row,
    parse_clients,
    percentile,
    ratios,
    requests_per_client,
    run_benchmark,
    run_level,
    split_requests,
    summarise,
)
from metaloom.bench.serve_prompts import PROMPTS
from metaloom.bench.servers import ServerSpec, StartFailed, serving, vllm_argv, vllm_env
from metaloom.errors import InvalidParameter

# ---------------------------------------------------------------- the fake server


def fake_tokens(prompt: str, max_tokens: int) -> int:
    """How many tokens the fake server streams for ``prompt``: varied, at most max_tokens."""
    return min(max_tokens, len(prompt) % 5 + 1)


class FakeHandler(BaseHTTPRequestHandler):
    """An OpenAI-style chat server: a role-only chunk, one chunk per token, a finish chunk, a
    usage chunk (unless mode is "no-usage"), then [DONE]. A prompt containing FAIL gets a 500;
    mode "die-after-N" exits the process after N completions; "slow-start" answers /health
    with 503 for its first 0.3 s."""

    mode = "ok"
    started = time.monotonic()
    served = 0
    prompts: ClassVar[list[str]] = []  # every prompt received (the in-thread server's, for the tests)

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            ready = self.mode != "slow-start" or time.monotonic() - self.started > 0.3
            self._json(200 if ready else 503, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0,
                                                         "owned_by": "test"}]})
        else:
            self._json(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        self.prompts.append(prompt)
        if "FAIL" in prompt:
            self._json(500, {"error": {"message": "asked to fail"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def chunk(delta: dict[str, str], finish: str | None = None, usage: dict[str, int] | None = None) -> None:
            choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
            event = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": choices, "usage": usage}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()

        n = fake_tokens(prompt, body["max_tokens"])
        chunk({"role": "assistant", "content": ""})
        time.sleep(0.003)  # a measurable first-token delay
        for _ in range(n):
            chunk({"content": "tok "})
            time.sleep(0.001)
        chunk({}, finish="length")
        if self.mode != "no-usage":
            chunk({}, usage={"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        type(self).served += 1
        if self.mode.startswith("die-after-") and type(self).served >= int(self.mode.removeprefix("die-after-")):
            os._exit(3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fake_server():
    """The fake server in a thread; yields a function setting its mode, and its /v1 URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (FakeHandler,), {"prompts": []}))
    handler = server.RequestHandlerClass
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def set_mode(mode: str) -> None:
        handler.mode = mode  # type: ignore[attr-defined]

    set_mode.prompts = handler.prompts  # type: ignore[attr-defined]
    yield set_mode, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def fake_spec(name: str, mode: str = "ok", timeout: float = 20.0) -> ServerSpec:
    port = free_port()
    return ServerSpec(name, (sys.executable, os.path.abspath(__file__), str(port), mode), port, dict(os.environ), timeout)


# ---------------------------------------------------------------- pure pieces


def test_percentile_interpolates_between_ranks_and_refuses_nonsense():
    # hand-computed (the function is numpy's; these pin the method, linear between closest ranks)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # halfway between ranks 1 and 2
    assert percentile([10.0, 0.0], 99) == pytest.approx(9.9)
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 25) == 2.0 and percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_split_covers_every_request_once_and_evenly():
    for total, clients in ((64, 1), (64, 8), (64, 32), (7, 3), (2, 5), (0, 4), (65, 8)):
        shares = split_requests(total, clients)
        assert len(shares) == clients
        flat = sorted(i for share in shares for i in share)
        assert flat == list(range(total))
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1
    assert split_requests(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        split_requests(4, 0)


def test_requests_per_client_and_levels_send_the_same_prompt_mix():
    assert [requests_per_client(64, n) for n in (1, 8, 32, 64)] == [64, 8, 2, 2]
    # 64 requests at each of 1, 8, 32 clients: every prompt exactly twice at every level
    for n in (1, 8, 32):
        total = n * requests_per_client(64, n)
        counts = [0] * len(PROMPTS)
        for share in split_requests(total, n):
            for i in share:
                counts[i % len(PROMPTS)] += 1
        assert counts == [2] * len(PROMPTS)


def test_prompts_are_distinct_and_mixed_in_length():
    assert len(PROMPTS) == 32 and len(set(PROMPTS)) == 32
    lengths = sorted(len(p) for p in PROMPTS)
    assert lengths[0] < 40 and lengths[-1] > 1500  # a few tokens up to a few hundred


def test_parse_clients():
    assert parse_clients("1,8,32") == (1, 8, 32)
    assert parse_clients("4") == (4,)
    for bad in ("", "0", "a,2", "1,-3"):
        with pytest.raises(InvalidParameter):
            parse_clients(bad)


def test_summarise_hand_made_timings():
    timings = [RequestTiming(0, latency_s=1.0, ttft_s=0.1, output_tokens=10),
               RequestTiming(1, latency_s=2.0, ttft_s=0.3, output_tokens=20),
               RequestTiming(2, latency_s=4.0, ttft_s=0.2, output_tokens=None),  # no usage chunk
               RequestTiming(3, latency_s=3.0, ttft_s=None, output_tokens=0),  # no content came
               RequestTiming(4, latency_s=0.5, error="boom")]
    row = summarise(8, timings, wall_s=5.0)
    assert row == LevelRow(clients=8, requests=5, errors=1, missing_usage=1, output_tokens=30, wall_s=5.0,
                           tokens_per_s=6.0, ttft_p50_s=pytest.approx(0.2), ttft_p99_s=pytest.approx(0.298),
                           latency_p50_s=2.5, latency_p99_s=pytest.approx(3.97))
    empty = summarise(1, [RequestTiming(0, latency_s=1.0, error="x")], wall_s=1.0)
    assert (empty.errors, empty.output_tokens, empty.tokens_per_s) == (1, 0, 0.0)
    assert empty.ttft_p50_s is None and empty.latency_p99_s is None


def _row(clients: int, tps: float, ttft: float | None, errors: int = 0) -> LevelRow:
    return LevelRow(clients, 10, errors, 0, int(tps), 1.0, tps, ttft, ttft, 1.0, 2.0)


def test_median_row_and_ratios():
    m = median_row([_row(8, 10.0, 0.3), _row(8, 30.0, None, errors=2), _row(8, 20.0, 0.1)])
    assert m["tokens_per_s"] == 20.0 and (m["tokens_per_s_min"], m["tokens_per_s_max"]) == (10.0, 30.0)
    assert m["ttft_p50_s"] == pytest.approx(0.2)  # over the repeats that have it
    assert (m["errors"], m["repeats"], m["latency_p99_s"]) == (2, 3, 2.0)
    r = ratios({"tokens_per_s": 30.0, "ttft_p50_s": 0.1, "ttft_p99_s": None, "latency_p50_s": 1.0, "latency_p99_s": 2.0},
               {"tokens_per_s": 20.0, "ttft_p50_s": 0.2, "ttft_p99_s": 0.5, "latency_p50_s": 0.0, "latency_p99_s": 4.0})
    assert r == {"tokens_per_s": 1.5, "ttft_p50_s": 0.5, "ttft_p99_s": None, "latency_p50_s": None, "latency_p99_s": 0.5}


def test_vllm_env_preloads_only_what_exists():
    present = {"/t/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"}
    env = vllm_env("/venv", {"PATH": "/bin"}, [0, 1], exists=present.__contains__,
                   tcmalloc=["/missing/libtcmalloc_minimal.so.4", "/t/libtcmalloc_minimal.so.4"])
    assert env["LD_PRELOAD"] == "/t/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["PATH"] == "/bin"
    bare = vllm_env("/venv", {}, [0, 2], exists=lambda p: False)
    assert "LD_PRELOAD" not in bare and "VLLM_CPU_OMP_THREADS_BIND" not in bare  # no contiguous range to bind


def test_vllm_argv_uses_the_module_when_the_distribution_is_vllm_cpu():
    common = ("--host", "127.0.0.1", "--port", "9", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048")
    assert vllm_argv("/v", "/m", 9, "bfloat16") == ("/v/bin/vllm", "serve", "/m", *common)
    assert vllm_argv("/v", "/m", 9, "bfloat16", named_vllm=False) == (
        "/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", *common)


# ---------------------------------------------------------------- client loop against the fake server


def test_run_level_measures_every_request(fake_server):
    _set_mode, url = fake_server
    prompts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff FAIL"]
    timings, wall = asyncio.run(run_level(url, "fake-model", prompts, clients=3, per_client=4, max_tokens=3))
    assert [t.request for t in timings] == list(range(12))
    for t in timings:
        prompt = prompts[t.request % len(prompts)]
        if "FAIL" in prompt:
            assert t.error is not None and "500" in t.error
            continue
        assert t.error is None
        assert t.output_tokens == fake_tokens(prompt, 3)
        assert t.ttft_s is not None and 0.003 <= t.ttft_s <= t.latency_s <= wall
    row = summarise(3, timings, wall)
    assert row.errors == 2 and row.output_tokens == sum(t.output_tokens or 0 for t in timings)
    assert row.ttft_p99_s is not None and row.latency_p50_s is not None and row.ttft_p99_s <= max(t.latency_s for t in timings)


def test_run_level_tags_make_every_request_distinct(fake_server):
    server, url = fake_server
    prompts = ["alpha", "beta"]
    asyncio.run(run_level(url, "fake-model", prompts, clients=2, per_client=3, max_tokens=2, tag="8-"))
    assert sorted(server.prompts) == sorted(f"[8-{i}] {prompts[i % 2]}" for i in range(6))
    server.prompts.clear()
    asyncio.run(run_level(url, "fake-model", prompts, clients=2, per_client=2, max_tokens=2))
    assert sorted(server.prompts) == ["alpha", "alpha", "beta", "beta"]  # untagged: the bare prompts


def test_run_level_counts_requests_without_usage(fake_server):
    set_mode, url = fake_server
    set_mode("no-usage")
    timings, wall = asyncio.run(run_level(url, "fake-model", ["hello"], clients=2, per_client=2, max_tokens=8))
    row = summarise(2, timings, wall)
    assert (row.requests, row.errors, row.missing_usage, row.output_tokens) == (4, 0, 4, 0)
    assert all(t.ttft_s is not None and t.ttft_s <= t.latency_s for t in timings)


# ---------------------------------------------------------------- server processes and the A/B loop


def test_serving_waits_for_health_and_stops_the_process():
    spec = fake_spec("fake", "slow-start")
    with serving(spec) as served:
        assert served.model == "fake-model" and served.startup_s >= 0.3
        assert served.alive() and served.base_url == f"http://127.0.0.1:{spec.port}/v1"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", spec.port)) != 0:
                break
        time.sleep(0.05)
    else:
        pytest.fail("the server still listens after the context ended")


def test_serving_reports_a_failed_start_with_its_output():
    spec = ServerSpec("broken", (sys.executable, "-c", "import sys; print('loading...'); sys.exit('no such model')"),
                      free_port(), dict(os.environ), 10.0)
    with pytest.raises(StartFailed) as info, serving(spec):
        pass
    assert "exited with status 1" in info.value.reason and "no such model" in info.value.tail
    missing = ServerSpec("missing", ("/nonexistent/vllm", "serve"), free_port(), {}, 5.0)
    with pytest.raises(StartFailed, match="cannot run"), serving(missing):
        pass


def test_serving_times_out_and_refuses_a_busy_port():
    spec = ServerSpec("mute", (sys.executable, "-c", "import time; time.sleep(60)"), free_port(), dict(os.environ), 0.5)
    start = time.monotonic()
    with pytest.raises(StartFailed, match="no 200 from /health"), serving(spec):
        pass
    assert time.monotonic() - start < 5  # the sleeper was stopped, not waited for
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = ServerSpec("busy", (sys.executable, "-c", "pass"), s.getsockname()[1], {}, 5.0)
        with pytest.raises(StartFailed, match="already in use"), serving(busy):
            pass


def test_run_benchmark_alternates_systems_and_reports_medians_ratios_and_skips():
    log: list[str] = []
    specs = [fake_spec("metaloom"), fake_spec("vllm")]
    out = run_benchmark(specs, levels=(1, 4), total_requests=8, max_tokens=4, repeats=2, prompts=PROMPTS[:6],
                        log=log.append)
    starts = [line.split("]")[0][1:] for line in log if line.endswith("starting")]
    assert starts == ["metaloom", "vllm", "metaloom", "vllm"]  # A B A B
    assert out["skipped"] == {}
    for name in ("metaloom", "vllm"):
        assert [r["clients"] for r in out["runs"][name]] == [1, 4, 1, 4]
        assert [r["requests"] for r in out["runs"][name]] == [8, 8, 8, 8]
        for c in (1, 4):
            m = out["medians"][name][c]
            assert m["repeats"] == 2 and m["errors"] == 0 and m["tokens_per_s"] > 0
            assert m["ttft_p50_s"] <= m["latency_p50_s"]
    assert out["ratio_of"] == "metaloom/vllm" and set(out["ratios"]) == {1, 4}
    assert all(v is not None and v > 0 for r in out["ratios"].values() for v in r.values())
    out.update({"model": "fake", "dtype": "bfloat16", "max_tokens": 4, "requests_per_level": {1: 8, 4: 8},
                "cpus": 2, "loadavg_start": [0.5, 0.4, 0.3]})
    out["skipped"]["other"] = {"reason": "it broke", "repeat": 1, "output_tail": "line 1\nTraceback: boom\n"}
    table = format_table(out)
    assert "metaloom/vllm" in table and "other skipped: it broke" in table and "    Traceback: boom" in table
    assert format_table(json.loads(json.dumps(out))) == table  # --json output is plain JSON, and renders the same


def test_run_benchmark_skips_a_system_that_fails_or_dies():
    broken = ServerSpec("vllm", (sys.executable, "-c", "import sys; sys.exit('cannot load')"), free_port(),
                        dict(os.environ), 10.0)
    dying = fake_spec("metaloom", "die-after-3")  # warm-up + 2 requests, then it exits mid-level
    out = run_benchmark([dying, broken], levels=(1,), total_requests=4, max_tokens=2, repeats=2,
                        prompts=PROMPTS[:4], log=lambda s: None)
    assert out["skipped"]["vllm"]["repeat"] == 1 and "cannot load" in out["skipped"]["vllm"]["output_tail"]
    assert out["skipped"]["metaloom"]["repeat"] == 1 and "during the 1-client level" in out["skipped"]["metaloom"]["reason"]
    assert out["runs"] == {"metaloom": [], "vllm": []} and out["ratios"] == {}


if __name__ == "__main__":  # the fake server as a process: PORT MODE
    FakeHandler.mode = sys.argv[2]
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), FakeHandler).serve_forever()


def test_metaloom_serve_args_reach_the_metaloom_command_only():
    import argparse

    from metaloom.bench.serve import _specs, add_args

    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--serve-dtype", "float32", "--metaloom-serve-args", "--activations q8 --max-rows 32"])
    specs, skipped = _specs(args, folder=None, folder_error=None)
    assert [s.name for s in specs] == ["metaloom"] and skipped == {}
    argv = list(specs[0].argv)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[-4:] == ["--activations", "q8", "--max-rows", "32"]
    assert "--metaloom-serve-args" not in argv
