#!/usr/bin/env bash
# tests/slurm/bench_prolog.sh [N]: the Prolog's wall time over N job starts (default 100) on the
# path a site runs every day: a real Slurm from harness.sh, our Prolog and Epilog, and a real
# cdgpcd (SQLite, HMAC) that every Prolog registers with. Prints harness.sh's JSON (p50/p99 of the
# Prolog's wall time) plus how many of the N jobs the head stored. Root; stops what it started.
set -euo pipefail

N=${1:-100}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CDGPC_PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
WORK=$(mktemp -d /tmp/cdgpc-prolog-bench.XXXXXX)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
HEAD_PID=""

cleanup() {
    [ -n "$HEAD_PID" ] && kill "$HEAD_PID" 2>/dev/null && wait "$HEAD_PID" 2>/dev/null || true
    CDGPC_SLURM_LAB=$WORK/lab bash "$REPO/tests/slurm/harness.sh" stop >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

head -c 32 /dev/urandom >"$WORK/hmac.key"
chmod 600 "$WORK/hmac.key"
AUTH="[auth]
method = \"hmac\"
hmac_key_file = \"$WORK/hmac.key\"
hmac_is_admin = true"
cat >"$WORK/head.toml" <<EOF
$AUTH
[head]
listen_address = "127.0.0.1"
listen_port = $PORT
[store]
url = "sqlite:///$WORK/cdgpc.db"
EOF
cat >"$WORK/hooks.toml" <<EOF
$AUTH
[head]
url = "http://127.0.0.1:$PORT"
EOF

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
"$PY" -m slurm_cdgpc.coordinator.main --config "$WORK/head.toml" 2>"$WORK/head.log" &
HEAD_PID=$!
for _ in $(seq 1 100); do
    grep -q "cdgpcd listening" "$WORK/head.log" && break
    sleep 0.1
done
grep -q "cdgpcd listening" "$WORK/head.log" || { cat "$WORK/head.log" >&2; exit 1; }

export CDGPC_SLURM_LAB=$WORK/lab CDGPC_PYTHON=$PY CDGPC_SLURM_HOOK_CONFIG=$WORK/hooks.toml
bash "$REPO/tests/slurm/harness.sh" start
RESULT=$(bash "$REPO/tests/slurm/harness.sh" bench "$N")
STORED=$("$PY" - "$WORK/cdgpc.db" <<'EOF'
import sqlite3, sys
print(sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM jobs").fetchone()[0])
EOF
)
echo "${RESULT%\}}, \"jobs_stored_by_head\": $STORED, \"head\": \"cdgpcd (SQLite, HMAC)\"}"
