#!/usr/bin/env bash
# Starts redis-server on 127.0.0.1:$K3_REDIS_PORT as a daemon with a pid file. Nothing is persisted (no RDB
# snapshots, no append-only file): in k3 Redis is a cache tier, and a restart starting empty is correct.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_redis
if pid="$(redis_pid)"; then
    echo "redis: already running on 127.0.0.1:$K3_REDIS_PORT (pid $pid)"
    exit 0
fi
if port_open "$K3_REDIS_PORT"; then die "port $K3_REDIS_PORT on 127.0.0.1 is already in use by another process"; fi
mkdir -p "$K3_REDIS_RUN_DIR"
rm -f "$REDIS_PID_FILE"
redis-server --bind 127.0.0.1 --port "$K3_REDIS_PORT" --daemonize yes \
    --pidfile "$REDIS_PID_FILE" --logfile "$REDIS_LOG_FILE" --dir "$K3_REDIS_RUN_DIR" \
    --save "" --appendonly no
deadline=$((SECONDS + K3_REDIS_START_TIMEOUT))
until port_open "$K3_REDIS_PORT" && redis_pid >/dev/null; do
    if ((SECONDS >= deadline)); then
        echo "--- last lines of $REDIS_LOG_FILE ---" >&2
        tail -n 20 "$REDIS_LOG_FILE" >&2 || true
        die "redis-server did not accept connections on 127.0.0.1:$K3_REDIS_PORT within ${K3_REDIS_START_TIMEOUT}s"
    fi
    sleep 0.1
done
echo "redis: running on 127.0.0.1:$K3_REDIS_PORT (pid $(redis_pid), log $REDIS_LOG_FILE)"
