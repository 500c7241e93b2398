#!/usr/bin/env bash
# The README's first command on a fresh machine (`make fresh-check`; `make test` runs it first): in a
# new venv with the runtime only and an empty model cache, `make serve`'s two steps (its install
# recipe, then `baton serve`, on free ports), one chat request that must answer "Paris", then Ctrl-C:
# the stack must be gone promptly, exit 0, no traceback. Also: `from baton import LLM` in the folder
# above a clone named baton. Any failure prints the log's tail and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."

INSTALL_TIMEOUT_S=900      # a cold pip cache downloads torch and the rest
READY_TIMEOUT_S=300        # the first start fetches and converts the model
ANSWER_TIMEOUT_S=60
STOP_TIMEOUT_S=30          # the workers' own grace is for in-flight streams; there are none

WORK=$(mktemp -d "${TMPDIR:-/tmp}/baton-fresh.XXXXXX")
VENV=$WORK/venv
LOG=$WORK/install.log      # then serve.log: what fail() shows the tail of
SERVE_PID=
T0=$SECONDS

cleanup() {
    if [ -n "$SERVE_PID" ] && kill -0 -- "-$SERVE_PID" 2>/dev/null; then
        kill -KILL -- "-$SERVE_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
    echo "fresh-check FAILED: $*" >&2
    echo "--- the last 40 lines of its log ($((SECONDS - T0))s in) ---" >&2
    tail -n 40 "$LOG" >&2 || true
    exit 1
}

# wait_exit PID SECONDS: the process's exit status, or 124 if it is still running after SECONDS.
wait_exit() {
    local deadline=$((SECONDS + $2))
    while kill -0 "$1" 2>/dev/null; do
        [ $SECONDS -lt $deadline ] || return 124
        sleep 0.5
    done
    wait "$1"
}

# Nothing from the caller's environment that the README's reader would not have.
for var in $(compgen -e); do
    case $var in BATON_* | PYTHONPATH | VIRTUAL_ENV) unset "$var" ;; esac
done
export BATON_CACHE_DIR=$WORK/cache

echo "[fresh-check] installing the runtime into a new venv ($VENV) ..." >&2
make --no-print-directory VENV="$VENV" "$VENV/.installed" >"$LOG" 2>&1 &
status=0; wait_exit $! "$INSTALL_TIMEOUT_S" || status=$?
[ $status -eq 0 ] || fail "make serve's install step exited with $status (124: timed out)"
! grep -q "^ERROR" "$LOG" || fail "the install printed an ERROR"
# the offline API, from the folder above a clone named baton (whose root must not hide the package)
mkdir "$WORK/above" && ln -s "$PWD" "$WORK/above/baton"
(cd "$WORK/above" && "$VENV/bin/python" -c "from baton import LLM") >>"$LOG" 2>&1 \
    || fail "from baton import LLM fails in the folder above a clone named baton"
INSTALLED=$SECONDS

read -r PORT HTTP_PORT < <("$VENV/bin/python" -c 'import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export BATON_PORT=$PORT BATON_HTTP_PORT=$HTTP_PORT
LOG=$WORK/serve.log
echo "[fresh-check] baton serve (gRPC $PORT, HTTP $HTTP_PORT, empty model cache) ..." >&2
# its own process group, as in a terminal, so that Ctrl-C (SIGINT to the group) reaches every process
"$VENV/bin/python" -c 'import os, sys; os.setpgrp(); os.execv(sys.argv[1], sys.argv[1:])' \
    "$VENV/bin/baton" serve >"$LOG" 2>&1 &
SERVE_PID=$!
until grep -q "baton is serving on" "$LOG"; do
    kill -0 "$SERVE_PID" 2>/dev/null || fail "baton serve exited before it was serving"
    [ $((SECONDS - INSTALLED)) -lt $READY_TIMEOUT_S ] || fail "not serving after ${READY_TIMEOUT_S}s"
    sleep 0.5
done
READY=$SECONDS

answer=$("$VENV/bin/python" - "$HTTP_PORT" "$ANSWER_TIMEOUT_S" <<'EOF' 2>>"$LOG"
import json, sys, urllib.request
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=float(sys.argv[2])) as reply:
    print(json.load(reply)["choices"][0]["message"]["content"])
EOF
) || fail "the chat request failed"
echo "[fresh-check] answer: $answer" | tee -a "$LOG" >&2
[[ $answer == *Paris* ]] || fail "the answer does not say Paris"
ANSWERED=$SECONDS

kill -INT -- "-$SERVE_PID"
status=0; wait_exit "$SERVE_PID" "$STOP_TIMEOUT_S" || status=$?
[ $status -ne 124 ] || fail "baton serve still running ${STOP_TIMEOUT_S}s after Ctrl-C"
[ $status -eq 0 ] || fail "baton serve exited with $status after Ctrl-C"
sleep 0.5
! kill -0 -- "-$SERVE_PID" 2>/dev/null || fail "processes of the stack outlived baton serve"
! grep -q "Traceback" "$LOG" || fail "a traceback in the log"
echo "[fresh-check] passed in $((SECONDS - T0))s: install $((INSTALLED - T0))s, first start" \
     "$((READY - INSTALLED))s, answer $((ANSWERED - READY))s, Ctrl-C $((SECONDS - ANSWERED))s" >&2
