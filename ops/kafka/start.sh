#!/usr/bin/env bash
# Starts a single-node Kafka 4.x broker in KRaft mode (one JVM is both broker and controller).
#
# The data directory survives stop/start: storage is formatted only when it has never been formatted, so
# a restarted broker serves everything it had acknowledged before. Configuration is rewritten on every
# start from the environment (see common.sh), which keeps the scripts the single source of truth.
# The JVM runs in its own session (setsid) so that a Ctrl-C in the calling terminal does not kill it;
# stop.sh stops it by pid.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_java
if pid="$(kafka_pid)"; then
    echo "kafka: already running on 127.0.0.1:$K3_KAFKA_PORT (pid $pid)"
    exit 0
fi
for port in "$K3_KAFKA_PORT" "$K3_KAFKA_CONTROLLER_PORT"; do
    if port_open "$port"; then die "port $port on 127.0.0.1 is already in use by another process"; fi
done
if ! libs="$(cached_libs_dir)"; then
    bash "$(dirname "${BASH_SOURCE[0]}")/fetch.sh"
    libs="$(cached_libs_dir)"
fi

mkdir -p "$K3_KAFKA_RUN_DIR/data"
config="$K3_KAFKA_RUN_DIR/server.properties"
cat >"$config" <<EOF
# Written by ops/kafka/start.sh; edits are overwritten on the next start.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$K3_KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$K3_KAFKA_PORT,CONTROLLER://127.0.0.1:$K3_KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$K3_KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$K3_KAFKA_RUN_DIR/data
num.partitions=1
auto.create.topics.enable=true
# One node: every internal topic has exactly one replica, and one in-sync replica is enough to ack.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
min.insync.replicas=1
# A few offsets partitions instead of 50: creating them is most of a fresh broker's first-group latency.
offsets.topic.num.partitions=4
# Tests start consumers one at a time; waiting for more members to join would only add latency.
group.initial.rebalance.delay.ms=0
EOF
cat >"$K3_KAFKA_RUN_DIR/log4j2.properties" <<EOF
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
EOF

# A development broker starts often and serves little: the client compiler alone (C1) and the serial
# collector halve the CPU a start costs, which matters on small CI machines. K3_KAFKA_JVM_OPTS overrides.
read -r -a tuning <<<"${K3_KAFKA_JVM_OPTS:--XX:TieredStopAtLevel=1 -XX:+UseSerialGC}"
java_opts=(-Xms"$K3_KAFKA_HEAP" -Xmx"$K3_KAFKA_HEAP" "${tuning[@]}" -Djava.awt.headless=true
    -Dlog4j2.configurationFile="$K3_KAFKA_RUN_DIR/log4j2.properties")

if [[ ! -f "$K3_KAFKA_RUN_DIR/data/meta.properties" ]]; then
    cluster_id="$(java "${java_opts[@]}" -cp "$libs/*" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)"
    [[ -n "$cluster_id" ]] || die "kafka.tools.StorageTool random-uuid printed no cluster id"
    if ! java "${java_opts[@]}" -cp "$libs/*" kafka.tools.StorageTool format -t "$cluster_id" -c "$config" \
        --standalone >"$K3_KAFKA_RUN_DIR/format.log" 2>&1; then
        tail -n 20 "$K3_KAFKA_RUN_DIR/format.log" >&2
        die "formatting the storage in $K3_KAFKA_RUN_DIR/data failed"
    fi
    echo "kafka: formatted $K3_KAFKA_RUN_DIR/data (cluster $cluster_id)"
fi

echo "kafka: starting broker on 127.0.0.1:$K3_KAFKA_PORT (controller :$K3_KAFKA_CONTROLLER_PORT, run dir $K3_KAFKA_RUN_DIR)"
setsid nohup java "${java_opts[@]}" -cp "$libs/*" kafka.Kafka "$config" >>"$KAFKA_LOG_FILE" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$KAFKA_PID_FILE"

deadline=$((SECONDS + K3_KAFKA_START_TIMEOUT))
until port_open "$K3_KAFKA_PORT"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        rm -f "$KAFKA_PID_FILE"
        echo "--- last lines of $KAFKA_LOG_FILE ---" >&2
        tail -n 30 "$KAFKA_LOG_FILE" >&2
        die "the broker exited during start-up"
    fi
    if ((SECONDS >= deadline)); then
        echo "--- last lines of $KAFKA_LOG_FILE ---" >&2
        tail -n 30 "$KAFKA_LOG_FILE" >&2
        die "the broker did not accept connections on 127.0.0.1:$K3_KAFKA_PORT within ${K3_KAFKA_START_TIMEOUT}s (still running as pid $pid; stop it with ops/kafka/stop.sh)"
    fi
    sleep 0.25
done
echo "kafka: running on 127.0.0.1:$K3_KAFKA_PORT (pid $pid, log $KAFKA_LOG_FILE)"
