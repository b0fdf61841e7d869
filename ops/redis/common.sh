# Shared settings for the local Redis scripts (sourced, not run).
#
#   K3_CACHE          cache root (default ~/.cache/k3)
#   K3_REDIS_PORT     port on 127.0.0.1 (default 16379, away from a system Redis on 6379)
#   K3_REDIS_RUN_DIR  pid and log files (default $K3_CACHE/run/redis-<port>)

K3_CACHE="${K3_CACHE:-$HOME/.cache/k3}"
K3_REDIS_PORT="${K3_REDIS_PORT:-16379}"
K3_REDIS_RUN_DIR="${K3_REDIS_RUN_DIR:-$K3_CACHE/run/redis-$K3_REDIS_PORT}"
K3_REDIS_START_TIMEOUT="${K3_REDIS_START_TIMEOUT:-20}"
REDIS_PID_FILE="$K3_REDIS_RUN_DIR/redis.pid"
REDIS_LOG_FILE="$K3_REDIS_RUN_DIR/redis.log"

die_missing() {
    echo "redis: $*" >&2
    exit 2
}

die() {
    echo "redis: $*" >&2
    exit 1
}

require_redis() {
    command -v redis-server >/dev/null 2>&1 || die_missing "redis-server not found; install it with: apt-get install redis-server"
}

redis_pid() {
    local pid
    [[ -f "$REDIS_PID_FILE" ]] || return 1
    pid="$(cat "$REDIS_PID_FILE")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
