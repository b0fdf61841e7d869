#!/usr/bin/env bash
# Stops the redis-server started by start.sh, by pid, and waits for it to exit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if ! pid="$(redis_pid)"; then
    rm -f "$REDIS_PID_FILE"
    echo "redis: not running (127.0.0.1:$K3_REDIS_PORT)"
    exit 0
fi
kill -TERM "$pid"
deadline=$((SECONDS + 20))
while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
        echo "redis: pid $pid did not exit within 20s; sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.1
done
rm -f "$REDIS_PID_FILE"
echo "redis: stopped (pid $pid)"
