"""`metaloom generate` and `metaloom run` with ``--backend openai``: the same answers through a
server (here `metaloom serve` on loopback) as from the local engine, and flags that need the local
engine refused by name."""

import json
import os
import subprocess
import sys

import pytest

from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.server.app import create_app
from metaloom.testing.served import serve_app

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([METALOOM, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def url(smollm):
    with serve_app(create_app(LocalGenerator(smollm), model_ids=["default"])) as base:
        yield base


def test_generate_through_a_server_equals_the_local_engine(url, smollm_generator):
    out = cli("generate", "Name a fruit.", "--backend", "openai", "--base-url", url, "--model", "default",
              "--temperature", "0", "--max-tokens", "10", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    local = smollm_generator.generate([Request.chat("Name a fruit.", SamplingParams(temperature=0, max_tokens=10))],
                                      ledger=Ledger())[0][0]
    got = data["completions"][0]
    assert (got["text"], got["tokens"]) == (local.text, list(local.token_ids))
    assert data["usage"]["output_tokens"] == len(local.token_ids) and data["model"] == "default"


def test_run_a_strategy_through_a_server(url):
    out = cli("run", "What is 2 + 3? Answer with a number.", "--strategy", "majority_vote", "--strategy.n", "3",
              "--strategy.extractor", "last_number", "--max-tokens", "16", "--seed", "4",
              "--backend", "openai", "--base-url", url, "--model", "default", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["candidates"]) == 3 and [e["kind"] for e in data["trace"]] == ["sample", "vote"]
    assert data["usage"]["output_tokens"] == sum(c["tokens"] for c in data["candidates"])


@pytest.mark.parametrize(("args", "needle"), [
    (["--backend", "openai"], "base-url"),
    (["--base-url", "http://127.0.0.1:9"], "base-url"),  # without --backend openai
    (["--backend", "openai", "--base-url", "http://127.0.0.1:9", "--speculative", "ngram"], "speculative"),
    (["--backend", "openai", "--base-url", "http://127.0.0.1:9", "--dtype", "bfloat16"], "dtype"),
])
def test_flags_that_do_not_fit_a_remote_server_are_refused_by_name(args, needle):
    out = cli("generate", "hi", *args)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


def test_a_server_that_is_not_there_is_a_clear_error():
    out = cli("generate", "hi", "--backend", "openai", "--base-url", "http://127.0.0.1:9", "--max-retries", "0",
              timeout=120)
    # status 3, not 2: no connection is not bad input (tests/test_remote_probe.py)
    assert out.returncode == 3 and "127.0.0.1:9" in out.stderr and "Traceback" not in out.stderr
