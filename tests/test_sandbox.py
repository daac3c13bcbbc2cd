"""The sandbox: limits hold, the network is unreachable, nothing is left behind; the weak hook
mode keeps the caller alive and the file system clean, and runs only on opt-in."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.sandbox import (
    WEAK_ENV,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    namespaces_available,
    resolve_mode,
    run_python,
)
from metaloom.sandbox import run as sandbox_run
from metaloom.score.execution import ExecutionScorer, run_tests

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
    # the C function under subprocess raises no audit event of its own: the sandbox wraps it
    r = run_python("import _posixsubprocess\n_posixsubprocess.fork_exec()", limits=limits("hook"))
    assert r.status == "failed" and "_posixsubprocess.fork_exec is not allowed" in r.failure
    # a subinterpreter would run without the audit hook
    r = run_python("import _xxsubinterpreters", limits=limits("hook"))
    assert r.status == "failed" and "importing _xxsubinterpreters is not allowed" in r.failure


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mb": 16},
                                {"output_kb": 0}, {"network": "off"}, {"allow_weak": "yes"}])
def test_limits_are_validated(kw):
    with pytest.raises(InvalidParameter):
        SandboxLimits(**kw)


def test_death_by_signal_is_an_error(mode):
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", limits=limits(mode))
    assert r.status == "error" and "SIGSEGV" in r.failure


# --- the weak hook mode: the caller lives on, the file system stays clean ---------------------

# Runs the sandbox from a throwaway process, so that a signal the hook failed to refuse reaches
# that process, not the test runner. It is started in a session of its own (a signal to its
# process group reaches nothing else) and keeps a witness process in its group (which does not
# hold our pipes: were the parent killed, the test would not wait for the witness).
_THROWAWAY_PARENT = """
import json, subprocess, sys
from metaloom.sandbox import SandboxLimits, run_python
witness = subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
r = run_python(sys.stdin.read(), limits=SandboxLimits(network="hook", timeout_s=10.0))
alive = witness.poll() is None
witness.kill()
witness.wait()
print(json.dumps({"status": r.status, "stdout": r.stdout, "failure": r.failure, "witness_alive": alive}))
"""

_ATTEMPTS = """
import json, os, resource, shutil, signal
out = {}
def attempt(name, call):
    try:
        call()
    except (PermissionError, ImportError) as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
    except Exception as exc:
        out[name] = "NOT REFUSED, but failed: " + type(exc).__name__ + ": " + str(exc)
    else:
        out[name] = "NOT REFUSED"
"""


def _run_under_throwaway_parent(code: str, prefix: tuple[str, ...] = ()) -> dict:
    proc = subprocess.run([*prefix, sys.executable, "-c", _THROWAWAY_PARENT], input=code, capture_output=True,
                          text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 0, f"the process that ran the sandbox died (status {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


def _refusals(status: str, stdout: str, failure: str) -> dict:
    """What the sandboxed ``_ATTEMPTS`` recorded; fails unless each attempt was refused."""
    assert status == "passed", failure
    out = json.loads(stdout)
    not_refused = {k: v for k, v in out.items() if not v.startswith(("PermissionError: sandbox:", "ImportError: sandbox:"))}
    assert not not_refused, not_refused
    assert all("not allowed" in v for v in out.values()), out
    return out


def test_hook_mode_keeps_the_caller_alive():
    code = _ATTEMPTS + """
parent = os.getppid()
attempt("kill parent", lambda: os.kill(parent, signal.SIGKILL))
attempt("kill parent's group", lambda: os.kill(-os.getpgid(parent), signal.SIGKILL))
attempt("killpg parent's group", lambda: os.killpg(os.getpgid(parent), signal.SIGKILL))
attempt("kill every process", lambda: os.kill(-1, 0))  # signal 0: checks, delivers nothing
attempt("pidfd_send_signal", lambda: signal.pidfd_send_signal(os.pidfd_open(parent), signal.SIGKILL))
attempt("prlimit parent", lambda: resource.prlimit(parent, resource.RLIMIT_CORE, (0, 0)))
os.kill(os.getpid(), 0)  # itself and its own group (only itself): allowed
os.killpg(0, 0)
signal.pthread_kill(__import__("threading").get_ident(), 0)
print(json.dumps(out))
"""
    r = _run_under_throwaway_parent(code)
    out = _refusals(r["status"], r["stdout"], r["failure"])
    assert "signals only to the program itself" in out["kill parent"]
    assert "os.kill to -1" in out["kill every process"]
    assert r["witness_alive"]


@pytest.mark.skipif(not namespaces_available(), reason="needs a PID namespace to contain a broken refusal")
def test_hook_mode_refuses_sigterm_to_every_process():
    # kill(-1, SIGTERM) reaches every process the user may signal: the throwaway parent runs in
    # a fresh PID namespace, so that even a broken refusal reaches only its witness
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    prefix = (shutil.which("unshare") or "unshare", *user, "--pid", "--fork", "--kill-child")
    code = _ATTEMPTS + "attempt('kill -1', lambda: os.kill(-1, signal.SIGTERM))\nprint(json.dumps(out))\n"
    r = _run_under_throwaway_parent(code, prefix)
    assert "os.kill to -1 is not allowed" in _refusals(r["status"], r["stdout"], r["failure"])["kill -1"]
    assert r["witness_alive"]


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.lstat().st_mode, p.lstat().st_mtime_ns,
                                         None if p.is_dir() else p.read_bytes()) for p in [folder, *folder.rglob("*")]}


def test_hook_mode_leaves_the_file_system_outside_untouched(tmp_path):
    victim, victim_dir = tmp_path / "victim.txt", tmp_path / "victim_dir"
    victim.write_text("keep")
    victim_dir.mkdir()
    (victim_dir / "inner.txt").write_text("keep")
    before = _snapshot(tmp_path)
    code = _ATTEMPTS + f"""
outside, victim, victim_dir = {str(tmp_path)!r}, {str(victim)!r}, {str(victim_dir)!r}
open("inside.txt", "w").write("mine")
here = os.open(".", os.O_RDONLY)
attempt("create", lambda: open(os.path.join(outside, "new.txt"), "x"))
attempt("overwrite", lambda: open(victim, "w"))
attempt("append", lambda: open(victim, "a"))
attempt("os.open", lambda: os.open(victim, os.O_WRONLY | os.O_TRUNC))
attempt("relative ..", lambda: open(os.path.relpath(os.path.join(outside, "rel.txt")), "w"))
attempt("via /proc", lambda: open("/proc/self/root" + victim, "w"))
attempt("remove", lambda: os.remove(victim))
attempt("rename out", lambda: os.rename("inside.txt", os.path.join(outside, "moved.txt")))
attempt("rename in", lambda: os.rename(victim, "stolen.txt"))
attempt("mkdir", lambda: os.mkdir(os.path.join(outside, "new_dir")))
attempt("rmtree", lambda: shutil.rmtree(victim_dir))
attempt("rmdir", lambda: os.rmdir(victim_dir))
attempt("copy", lambda: shutil.copy("inside.txt", outside))
attempt("chmod", lambda: os.chmod(victim, 0o777))
attempt("chmod by descriptor", lambda: os.chmod(os.open(victim, os.O_RDONLY), 0o777))  # reading is allowed
attempt("chmod from dir_fd", lambda: os.chmod(os.path.relpath(victim), 0o777, dir_fd=here))
attempt("utime", lambda: os.utime(victim, (0, 0)))
attempt("truncate", lambda: os.truncate(victim, 0))
attempt("hard link", lambda: os.link(victim, "hard.txt"))
attempt("mkfifo", lambda: os.mkfifo(os.path.join(outside, "fifo")))
attempt("mknod", lambda: os.mknod(os.path.join(outside, "node")))
attempt("directory descriptor", lambda: os.open("via_fd.txt", os.O_WRONLY | os.O_CREAT,
                                                dir_fd=os.open(outside, os.O_RDONLY)))
attempt("sqlite3", lambda: __import__("sqlite3").connect(os.path.join(outside, "db.sqlite")))

def climb_from_dir_fd():  # the open event does not say which directory a relative path starts from
    top = os.getcwd()
    deep = os.path.join(top, *["d"] * top.count(os.sep))
    os.makedirs(deep)
    os.chdir(deep)  # from here the path below seems to stay inside; from `here` (top) it leaves
    try:
        os.open(os.path.relpath(os.path.join(outside, "fd.txt"), top), os.O_WRONLY | os.O_CREAT, dir_fd=here)
    finally:
        os.chdir(top)
attempt("dir_fd climbing", climb_from_dir_fd)
print(json.dumps(out))
"""
    r = run_python(code, limits=limits("hook"))
    out = _refusals(r.status, r.stdout, r.failure)
    assert len(out) == 24
    assert "files may change only inside" in out["overwrite"] and "climb out" in out["relative .."]
    assert _snapshot(tmp_path) == before


def test_hook_mode_refuses_symbolic_links(tmp_path):
    code = _ATTEMPTS + f"""
attempt("symlink", lambda: os.symlink({str(tmp_path)!r}, "escape"))
try:  # through the link, had it been made
    open("escape/through.txt", "w")
except OSError as exc:
    out["write through"] = type(exc).__name__
print(json.dumps(out))
"""
    r = run_python(code, limits=limits("hook"))
    assert r.passed, r.failure
    out = json.loads(r.stdout)
    assert out["symlink"].startswith("PermissionError: sandbox: os.symlink is not allowed")
    assert out["write through"] in ("FileNotFoundError", "PermissionError")
    assert list(tmp_path.iterdir()) == []


def test_hook_mode_without_its_audit_hook_file_runs_nothing(tmp_path):
    """The runner loads the audit hook from ``_audit.py`` beside it, by path (``python -I`` has no
    script directory on sys.path); a runner that cannot load it sets nothing up and runs nothing."""
    from metaloom.sandbox import _runner

    runner = shutil.copy(_runner.__file__, tmp_path / "_runner.py")  # without _audit.py beside it
    (tmp_path / "work").mkdir()
    (tmp_path / "code.py").write_text("print('ran')\n")
    config = {"mode": "hook", "workdir": str(tmp_path / "work"), "source_path": str(tmp_path / "code.py"),
              "memory_bytes": 1 << 30, "cpu_seconds": 10, "file_bytes": 1 << 20}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-I", "-B", "-u", runner, str(tmp_path / "config.json")],
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (_runner.EXIT_SETUP, "")
    assert "sandbox setup failed: audit hook:" in proc.stderr and "_audit.py" in proc.stderr


def test_hook_mode_refuses_ctypes():
    for module in ("ctypes", "_ctypes", "ctypes.util"):
        r = run_python(f"import {module}\n", limits=limits("hook"))
        assert r.status == "failed" and "ImportError: sandbox: importing" in r.failure, r.failure
        assert "audit hook cannot see" in r.failure
    # numpy imports ctypes only optionally: it still works
    r = run_python("import numpy\nprint(int(numpy.arange(4).sum()))", limits=limits("hook"))
    assert r.passed and r.stdout == "6\n", r.failure


def test_hook_mode_still_lets_the_code_use_its_working_directory():
    code = """
import os, pathlib, shutil, sqlite3, tempfile
open("a.txt", "w").write("x")
os.mkdir("sub")
os.rename("a.txt", "sub/b.txt")
os.chmod("sub/b.txt", 0o600)
shutil.copy("sub/b.txt", "c.txt")
os.link("c.txt", "d.txt")
os.mkfifo("fifo")
here = os.open(".", os.O_RDONLY)
os.close(os.open("e.txt", os.O_WRONLY | os.O_CREAT, dir_fd=here))
with tempfile.TemporaryDirectory() as d:
    pathlib.Path(d, "t").write_text("t")
sqlite3.connect("db.sqlite").close()
shutil.rmtree("sub")
os.remove("c.txt")
open(os.devnull, "w").write("discarded")
print(sorted(os.listdir(".")))
"""
    r = run_python(code, limits=limits("hook"))
    assert r.passed, r.failure
    assert r.stdout == "['d.txt', 'db.sqlite', 'e.txt', 'fifo']\n"


# --- the weak mode runs only on opt-in ----------------------------------------------------------

@pytest.fixture
def no_namespaces(monkeypatch):
    """This machine as one without namespaces, and no opt-in in the environment."""
    monkeypatch.setattr(sandbox_run, "_namespace_probe", lambda: "unshare: unshare failed: Operation not permitted")
    monkeypatch.delenv(WEAK_ENV, raising=False)


def test_auto_without_namespaces_refuses_to_run_without_an_opt_in(no_namespaces, monkeypatch):
    monkeypatch.setattr(sandbox_run, "_run", lambda *a: pytest.fail("the code ran"))
    with pytest.raises(SandboxUnavailable) as info:
        run_python("print(1)", limits=SandboxLimits(network="auto"))
    assert isinstance(info.value, SandboxError) and isinstance(info.value, MetaloomError)
    message = str(info.value)
    assert "unshare failed: Operation not permitted" in message  # why
    assert "allow_weak=True" in message and "network='hook'" in message and f"{WEAK_ENV}=1" in message  # how
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)")  # the default limits
    with pytest.raises(SandboxUnavailable):
        resolve_mode("auto")
    monkeypatch.setenv(WEAK_ENV, "0")
    with pytest.raises(SandboxUnavailable):
        resolve_mode("auto")
    monkeypatch.setenv(WEAK_ENV, "maybe")
    with pytest.raises(InvalidParameter, match=WEAK_ENV):
        resolve_mode("auto")
    with pytest.raises(InvalidParameter, match="network"):
        resolve_mode("namespace")


def test_the_weak_mode_runs_when_the_caller_opts_in(no_namespaces, monkeypatch):
    assert resolve_mode("hook") == "hook"
    assert resolve_mode("auto", allow_weak=True) == "hook"
    assert run_python("print(1)", limits=SandboxLimits(network="auto", allow_weak=True)).mode == "hook"
    assert run_python("print(1)", limits=SandboxLimits(network="hook")).mode == "hook"
    monkeypatch.setenv(WEAK_ENV, "1")
    assert run_python("print(1)").mode == "hook"


def test_execution_scoring_surfaces_the_refusal(no_namespaces):
    with pytest.raises(SandboxUnavailable):
        run_tests("assert 1 + 1 == 2")
    scorer = ExecutionScorer(tests=("assert f() == 1",))
    candidate = Completion(text="def f():\n    return 1\n", token_ids=(), logprobs=(), finish_reason="stop")
    with pytest.raises(SandboxUnavailable, match="no strong sandbox here"):
        scorer.score("write f", [candidate], ledger=Ledger())
