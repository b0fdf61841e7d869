#!/usr/bin/env bash
# Stops the broker started by start.sh: SIGTERM (the broker shuts down cleanly and flushes its logs), wait,
# and SIGKILL only when it does not exit within K3_KAFKA_STOP_TIMEOUT seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if ! pid="$(kafka_pid)"; then
    rm -f "$KAFKA_PID_FILE"
    echo "kafka: not running (127.0.0.1:$K3_KAFKA_PORT)"
    exit 0
fi
kill -TERM "$pid"
deadline=$((SECONDS + K3_KAFKA_STOP_TIMEOUT))
while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
        echo "kafka: pid $pid did not exit within ${K3_KAFKA_STOP_TIMEOUT}s; sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
        break
    fi
    sleep 0.2
done
rm -f "$KAFKA_PID_FILE"
echo "kafka: stopped (pid $pid)"
