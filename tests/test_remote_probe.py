"""A server that cannot be reached is `ServerUnreachable` (naming the URL and the cause) and
`metaloom` exits with status 3 — at start-up, and when the server dies during feature probing,
which used to read every probe that failed as a feature it lacks ("unsupported params.seed",
exit status 2, the status of bad input)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from metaloom.cli import EXIT_UNREACHABLE, EXIT_USAGE
from metaloom.errors import ServerUnreachable
from metaloom.generator.remote import RemoteGenerator, RetryPolicy
from metaloom.testing.fake_openai import FakeOpenAI
from metaloom.testing.served import serve_app

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")
NO_RETRY = RetryPolicy(max_retries=0)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([METALOOM, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _answer(path: str, body: dict) -> dict:
    if path == "/v1/models":
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}
    choice = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": "x"}} if "messages" in body else {"text": "x"})
    return {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@contextlib.contextmanager
def dies_after(answered: int) -> Iterator[str]:
    """A server that answers its first ``answered`` requests (one per connection), then keeps
    accepting connections and closes each one at once, unanswered: a server going down."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    count = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                count[0] += 1
                if count[0] > answered:
                    continue  # closed without a word
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(v) for k, _, v in (line.partition(": ") for line in lines[1:])
                               if k.lower() == "content-length"), 0)
                while len(rest) < length:
                    rest += conn.recv(65536)
                out = json.dumps(_answer(lines[0].split()[1], json.loads(rest) if rest else {})).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(out)).encode() + b"\r\n\r\n" + out)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        thread.join(timeout=10)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_server_that_dies_mid_probe_is_unreachable_not_a_missing_feature():
    # it lists the model and answers both route probes, then goes
    with dies_after(3) as url, pytest.raises(ServerUnreachable) as info:
        RemoteGenerator(url, "m", retry=NO_RETRY)
    assert url in str(info.value) and "connection failed" in str(info.value)
    assert info.value.status is None


def test_a_closed_port_is_unreachable():
    url = closed_port()
    with pytest.raises(ServerUnreachable, match=r"cannot reach the server at http://127\.0\.0\.1:\d+/v1/models"):
        RemoteGenerator(url, "m", retry=NO_RETRY)


@pytest.mark.parametrize("where", ["dies mid-probe", "closed port"])
def test_the_cli_exits_3_naming_the_url_and_the_failure(where):
    args = ("run", "What is 2 + 3?", "--strategy", "majority_vote", "--strategy.n", "2", "--seed", "4", "--max-tokens",
            "4", "--backend", "openai", "--model", "m", "--max-retries", "0", "--base-url")
    if where == "closed port":
        url = closed_port()
        out = cli(*args, url)
    else:
        with dies_after(3) as url:
            out = cli(*args, url)
    assert out.returncode == EXIT_UNREACHABLE == 3, out.stderr
    assert f"cannot reach the server at {url}" in out.stderr and "connection failed" in out.stderr
    assert "unsupported" not in out.stderr and "Traceback" not in out.stderr


def test_bad_input_still_exits_2():
    fake = FakeOpenAI(replies={"hi": ["hello"]})
    with serve_app(fake.app) as url:
        out = cli("generate", "hi", "--backend", "openai", "--base-url", url, "--model", "not-served")
    assert out.returncode == EXIT_USAGE == 2 and "not-served" in out.stderr and "Traceback" not in out.stderr
    out = cli("generate", "hi", "--backend", "openai", "--base-url", closed_port(), "--speculative", "ngram")
    assert out.returncode == 2 and "speculative" in out.stderr


def test_the_exit_statuses_are_in_the_help():
    out = cli("--help")
    assert out.returncode == 0 and "exit status" in out.stdout and "3 a remote server" in out.stdout
