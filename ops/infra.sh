#!/usr/bin/env bash
# Local infrastructure for development and CI: Redis and a single-node Kafka broker on 127.0.0.1.
#
#   ops/infra.sh up|down|status|check [redis] [kafka]      (default: both)
#
# up checks every prerequisite before starting anything, so a missing tool never leaves half the services
# running; down stops in reverse order; status prints one line per component and the environment
# variables that point k3 at them. Exit status 2 means a prerequisite is missing (one line on stderr).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K3_REDIS_PORT="${K3_REDIS_PORT:-16379}"
K3_KAFKA_PORT="${K3_KAFKA_PORT:-19092}"
export K3_REDIS_PORT K3_KAFKA_PORT

usage() {
    echo "usage: ops/infra.sh up|down|status|check [redis] [kafka]" >&2
    exit 64
}

(($# >= 1)) || usage
action="$1"
shift
components=("$@")
if ((${#components[@]} == 0)); then components=(redis kafka); fi
for c in "${components[@]}"; do
    [[ "$c" == redis || "$c" == kafka ]] || { echo "infra: unknown component '$c' (expected redis or kafka)" >&2; exit 64; }
done

case "$action" in
check)
    for c in "${components[@]}"; do bash "$here/$c/check.sh"; done
    ;;
up)
    for c in "${components[@]}"; do bash "$here/$c/check.sh"; done
    for c in "${components[@]}"; do
        if [[ "$c" == kafka ]]; then bash "$here/kafka/fetch.sh"; fi
        bash "$here/$c/start.sh"
    done
    ;;
down)
    for ((i = ${#components[@]} - 1; i >= 0; i--)); do bash "$here/${components[i]}/stop.sh"; done
    ;;
status)
    for c in "${components[@]}"; do bash "$here/$c/status.sh" || true; done
    echo
    echo "# point k3 at them:"
    for c in "${components[@]}"; do
        case "$c" in
        redis) echo "export K3_REDIS_URL=redis://127.0.0.1:$K3_REDIS_PORT/0" ;;
        kafka) echo "export K3_KAFKA_BOOTSTRAP=127.0.0.1:$K3_KAFKA_PORT" ;;
        esac
    done
    ;;
*) usage ;;
esac
