"""The sandbox: limits hold, the network is unreachable, nothing is left behind."""

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import pytest

from metaloom.errors import InvalidParameter
from metaloom.sandbox import SandboxLimits, namespaces_available, resolve_mode, run_python
from metaloom.score.execution import run_tests

MODES = [
    pytest.param("namespace", marks=pytest.mark.skipif(not namespaces_available(), reason="unshare not permitted here")),
    "hook",
]


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def limits(mode, **kw):
    return SandboxLimits(network=mode, **{"timeout_s": 5.0, **kw})


def test_runs_code_with_stdin_and_reports_the_mode(mode):
    r = run_python("import sys\nprint(input()[::-1], sys.flags.isolated)", stdin="abc\n", limits=limits(mode))
    assert (r.status, r.passed, r.exit_code, r.failure) == ("passed", True, 0, "")
    assert r.stdout == "cba 1\n"
    assert r.mode == mode
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.status = "failed"  # type: ignore[misc]


def test_failure_text_names_the_failing_assert(mode):
    r = run_python("def f(x):\n    return x + 1\n\nassert f(1) == 3, 'f(1) is wrong'\n", limits=limits(mode))
    assert (r.status, r.passed, r.exit_code) == ("failed", False, 1)
    assert "AssertionError: f(1) is wrong" in r.failure
    assert "assert f(1) == 3" in r.failure  # the source line, though no file holds it
    assert "_runner" not in r.failure  # our own frame is not shown


def test_infinite_loop_is_killed_at_its_time_limit(mode):
    start = time.monotonic()
    r = run_python("print('started')\nwhile True:\n    pass\n", limits=limits(mode, timeout_s=1.0))
    elapsed = time.monotonic() - start
    assert r.status == "timeout" and r.exit_code is None and not r.passed
    assert "timed out after 1 s" in r.failure
    assert r.stdout == "started\n"  # output up to the kill is kept
    assert 1.0 <= r.duration_s < 3.0 and elapsed < 4.0  # returns promptly after the limit


def test_memory_hog_is_stopped(mode):
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    r = run_python(hog, limits=limits(mode, memory_mb=128))
    assert r.status == "memory" and not r.passed
    assert "memory limit of 128 MiB" in r.failure


def test_network_connections_fail(mode):
    # a real listening socket on loopback (traffic from the test itself stays on 127.0.0.1)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # control: outside the sandbox the port is reachable
        probe = f"""
import json, socket
def attempt(address):
    try:
        with socket.create_connection(address, timeout=2):
            return "connected"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)
out = {{"loopback": attempt(("127.0.0.1", {port}))}}
# only where loopback is unreachable (isolation works) try a public address; 192.0.2.1 is
# TEST-NET-1 (RFC 5737), which no real host answers even if isolation were broken
if out["loopback"] != "connected":
    out["public"] = attempt(("192.0.2.1", 80))
print(json.dumps(out))
"""
        r = run_python(probe, limits=limits(mode))
    assert r.passed, r.failure
    out = json.loads(r.stdout)
    assert out["loopback"] != "connected"
    assert out["public"] != "connected"
    expected = "Network is unreachable" if mode == "namespace" else "socket.__new__ is not allowed"
    assert expected in out["loopback"] and expected in out["public"]


def test_nothing_escapes_the_temporary_directory(mode, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "import os\nopen('written.txt', 'w').write('x')\nos.mkdir('sub')\nprint(os.getcwd())\n"
    r = run_python(code, limits=limits(mode))
    assert r.passed, r.failure
    workdir = Path(r.stdout.strip())
    assert workdir.name == "work" and workdir.parent.name.startswith("metaloom-sandbox-")
    assert not (tmp_path / "written.txt").exists() and not (tmp_path / "sub").exists()
    assert not workdir.exists() and not workdir.parent.exists()  # removed afterwards


def test_environment_is_clean(mode, monkeypatch):
    monkeypatch.setenv("METALOOM_TEST_SECRET", "s3cret")
    r = run_python("import os\nprint(sorted(os.environ))", limits=limits(mode))
    assert r.passed, r.failure
    assert "METALOOM_TEST_SECRET" not in r.stdout


def test_exit_codes_and_syntax_errors(mode):
    r = run_python("import sys\nsys.exit(3)", limits=limits(mode))
    assert (r.status, r.exit_code, r.failure) == ("failed", 3, "exit status 3")
    r = run_python("def f(:\n", limits=limits(mode))
    assert r.status == "failed" and "SyntaxError" in r.failure


def test_early_exit_before_the_tests_is_not_a_pass(mode):
    program = "import sys\ndef f():\n    return 1\nsys.exit(0)\nassert f() == 2\n"
    assert run_python(program, limits=limits(mode)).passed  # as a plain program, exit 0 is success
    r = run_tests(program, limits=limits(mode))  # as a test run, the asserts never ran
    assert r.status == "failed" and "exited before its tests finished" in r.failure
    assert run_tests("assert 1 + 1 == 2", limits=limits(mode)).passed


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(pid)
    return found


@pytest.mark.skipif(not namespaces_available(), reason="unshare not permitted here")
def test_namespace_mode_kills_every_process_the_code_started():
    spawn = "import subprocess\nsubprocess.Popen(['sleep', '{}'], start_new_session=True)\n"
    r = run_python(spawn.format("41.123") + "print('spawned')", limits=limits("namespace"))
    assert r.passed, r.failure
    r = run_python(spawn.format("41.456") + "while True:\n    pass\n", limits=limits("namespace", timeout_s=1.0))
    assert r.status == "timeout"
    time.sleep(0.2)  # the kernel tears the namespace down asynchronously
    assert _processes_with("41.123") == [] and _processes_with("41.456") == []


@pytest.mark.skipif(not namespaces_available(), reason="unshare not permitted here")
def test_namespace_mode_makes_the_rest_of_the_file_system_read_only(tmp_path):
    target = tmp_path / "outside.txt"
    code = (f"import os, resource\nos.system('mount -o remount,rw / 2>/dev/null')\n"
            f"open({str(target)!r}, 'w').write('x')\n")
    r = run_python(code, limits=limits("namespace"))
    assert r.status == "failed" and "Read-only file system" in r.failure
    assert not target.exists()
    r = run_python("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", limits=limits("namespace"))
    assert r.status == "failed" and "not allowed to raise maximum limit" in r.failure
    # /dev/shm is a private tmpfs: writable (multiprocessing's locks work), gone afterwards
    shm = Path("/dev/shm/metaloom-sandbox-test-shm")
    code = f"open({str(shm)!r}, 'w').write('x')\nimport multiprocessing\nmultiprocessing.Lock()\nprint('ok')"
    r = run_python(code, limits=limits("namespace"))
    assert r.passed, r.failure
    assert not shm.exists()


def test_hook_mode_refuses_new_processes():
    r = run_python("import subprocess\nsubprocess.run(['true'])", limits=limits("hook"))
    assert r.status == "failed" and "subprocess.Popen is not allowed" in r.failure
    r = run_python("import os\nos.fork()", limits=limits("hook"))
    assert r.status == "failed" and "os.fork is not allowed" in r.failure


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mb": 16},
                                {"output_kb": 0}, {"network": "off"}])
def test_limits_are_validated(kw):
    with pytest.raises(InvalidParameter):
        SandboxLimits(**kw)


def test_death_by_signal_is_an_error(mode):
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", limits=limits(mode))
    assert r.status == "error" and "SIGSEGV" in r.failure


def test_auto_falls_back_to_the_hook_without_namespaces(monkeypatch):
    from metaloom.sandbox import run as sandbox_run

    monkeypatch.setattr(sandbox_run, "namespaces_available", lambda: False)
    assert resolve_mode("auto") == "hook" and resolve_mode("hook") == "hook"
    with pytest.raises(InvalidParameter, match="network"):
        resolve_mode("namespace")
    assert run_python("print(1)", limits=SandboxLimits(network="auto")).mode == "hook"
