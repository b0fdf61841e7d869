#!/usr/bin/env bash
# Prints one line about the Redis server; exit status 0 when it is running, 3 when it is not.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if pid="$(redis_pid)"; then
    echo "redis  running  127.0.0.1:$K3_REDIS_PORT  (pid $pid, run dir $K3_REDIS_RUN_DIR)"
    exit 0
fi
echo "redis  stopped  127.0.0.1:$K3_REDIS_PORT"
exit 3
