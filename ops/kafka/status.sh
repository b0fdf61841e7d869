#!/usr/bin/env bash
# Prints one line about the broker; exit status 0 when it is running, 3 when it is not (LSB convention).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if pid="$(kafka_pid)"; then
    echo "kafka  running  127.0.0.1:$K3_KAFKA_PORT  (pid $pid, run dir $K3_KAFKA_RUN_DIR)"
    exit 0
fi
echo "kafka  stopped  127.0.0.1:$K3_KAFKA_PORT"
exit 3
