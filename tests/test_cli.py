"""The CLI's contract: JSON shape, streaming, and one clear error line for bad input."""

import json
import os
import subprocess
import sys

import pytest

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def run(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([METALOOM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_json_contract():
    out = run("generate", "Name a fruit.", "--json", "--n", "2", "--max-tokens", "8", "--seed", "1")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"completions", "usage"}
    assert len(data["completions"]) == 2
    for c in data["completions"]:
        assert set(c) == {"text", "tokens", "logprob", "finish_reason", "stop_reason"}
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
        assert all(isinstance(t, int) for t in c["tokens"]) and 1 <= len(c["tokens"]) <= 8
        assert c["logprob"] <= 0
    assert set(data["usage"]) >= {"input_tokens", "cached_tokens", "output_tokens", "forward_passes", "flops", "seconds"}
    assert data["usage"]["output_tokens"] == sum(len(c["tokens"]) for c in data["completions"])


def test_generate_streams_text_raw_mode():
    out = run("generate", "Once upon a time", "--raw", "--temperature", "0", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0


@pytest.mark.parametrize(("args", "needle"), [
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--n", "0"], "n=0"),
    (["--max-tokens", "-3"], "max_tokens"),
    (["--model", "/nonexistent/model.gguf"], "does not exist"),
    (["--model", __file__], "not a model"),
    (["--dtype", "int3"], "dtype"),
])
def test_bad_input_is_one_clear_line_and_nonzero_exit(args, needle):
    out = run("generate", "hi", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], out.stderr
    assert out.stdout == ""


def test_prompt_longer_than_context_window():
    out = run("generate", "word " * 9000, "--max-tokens", "4")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "context window" in out.stderr


def test_bench_speculative_unknown_peer_fails_before_loading_anything():
    out = run("bench", "speculative", "--peers", "transformers,vllm", timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "peers" in lines[0] and "vllm" in lines[0], out.stderr
