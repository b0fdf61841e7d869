# Shared settings for the local single-node Kafka broker scripts (sourced, not run).
#
# Everything is driven by environment variables so that tests and CI can run a broker on another port or
# with its own data directory without editing files:
#   K3_CACHE            cache root (default ~/.cache/k3); jars live in $K3_CACHE/kafka-<version>/libs
#   K3_KAFKA_VERSION    Kafka version to fetch; when unset the newest of KAFKA_VERSIONS that resolves is used
#   K3_KAFKA_PORT       client (PLAINTEXT) port, default 19092; the KRaft controller listens on port+1
#   K3_KAFKA_RUN_DIR    config, data, pid and log files (default $K3_CACHE/run/kafka-<port>)
#   K3_KAFKA_HEAP       JVM heap size (default 512m; a test broker needs little)
#   K3_KAFKA_JVM_OPTS   JVM tuning flags (default: fast start, see start.sh)
#   K3_KAFKA_START_TIMEOUT / K3_KAFKA_STOP_TIMEOUT   seconds to wait (defaults 120 / 60)

K3_CACHE="${K3_CACHE:-$HOME/.cache/k3}"
# Newest first. The first entry is the version the project targets; the others are fall-backs for a Maven
# mirror that does not carry it yet. All are Kafka 4.x, i.e. KRaft-only brokers.
KAFKA_VERSIONS=(4.4.0 4.3.0 4.2.0 4.1.1 4.1.0 4.0.0)
# Kafka's POM leaves the logging back-end to the distribution; the broker needs a log4j2 implementation.
LOG4J_VERSION="2.24.3"
SLF4J_VERSION="2.0.16"
K3_KAFKA_PORT="${K3_KAFKA_PORT:-19092}"
K3_KAFKA_CONTROLLER_PORT="$((K3_KAFKA_PORT + 1))"
K3_KAFKA_RUN_DIR="${K3_KAFKA_RUN_DIR:-$K3_CACHE/run/kafka-$K3_KAFKA_PORT}"
K3_KAFKA_HEAP="${K3_KAFKA_HEAP:-512m}"
K3_KAFKA_START_TIMEOUT="${K3_KAFKA_START_TIMEOUT:-120}"
K3_KAFKA_STOP_TIMEOUT="${K3_KAFKA_STOP_TIMEOUT:-60}"
KAFKA_PID_FILE="$K3_KAFKA_RUN_DIR/kafka.pid"
KAFKA_LOG_FILE="$K3_KAFKA_RUN_DIR/kafka.log"

# Exit status 2 means "a prerequisite is missing" everywhere in ops/; callers show the message as is.
die_missing() {
    echo "kafka: $*" >&2
    exit 2
}

die() {
    echo "kafka: $*" >&2
    exit 1
}

# Java 17 or newer: Kafka 4.x brokers do not run on older JVMs.
require_java() {
    command -v java >/dev/null 2>&1 || die_missing "java not found; install a JDK 17+ (apt-get install openjdk-17-jre-headless)"
    local line major
    line="$(java -version 2>&1 | head -n 1)"
    major="$(sed -E 's/.*version "([0-9]+)(\.[0-9]+)*.*/\1/' <<<"$line")"
    if [[ "$major" == "1" ]]; then major=8; fi
    [[ "$major" =~ ^[0-9]+$ ]] || die_missing "cannot read the Java version from: $line"
    ((major >= 17)) || die_missing "java $major found; Kafka 4.x needs Java 17 or newer"
}

require_mvn() {
    command -v mvn >/dev/null 2>&1 || die_missing "mvn not found and the Kafka jars are not cached; install Maven (apt-get install maven)"
}

# Prints the libs directory of the first cached (complete) Kafka version, or nothing. A version counts as
# cached only once fetch.sh has written its .complete marker, so a half-finished download is never used.
cached_libs_dir() {
    local version
    local candidates=("${KAFKA_VERSIONS[@]}")
    if [[ -n "${K3_KAFKA_VERSION:-}" ]]; then candidates=("$K3_KAFKA_VERSION"); fi
    for version in "${candidates[@]}"; do
        if [[ -f "$K3_CACHE/kafka-$version/.complete" ]]; then
            echo "$K3_CACHE/kafka-$version/libs"
            return 0
        fi
    done
    return 1
}

# Returns 0 when the pid file names a live process.
kafka_pid() {
    local pid
    [[ -f "$KAFKA_PID_FILE" ]] || return 1
    pid="$(cat "$KAFKA_PID_FILE")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
