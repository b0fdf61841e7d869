#!/usr/bin/env bash
# Fetches the Kafka broker jars from Maven Central into $K3_CACHE/kafka-<version>/libs.
#
# There is no Kafka distribution tarball on Maven Central, but the broker is an ordinary artifact
# (org.apache.kafka:kafka_2.13) whose POM lists everything it needs at runtime except a logging back-end.
# A throw-away POM that depends on it plus log4j2 lets `mvn dependency:copy-dependencies` assemble a
# complete classpath. The Maven repository is kept under $K3_CACHE/m2, so one cache directory holds all
# downloads, and a version whose libs are complete (marker file) is never fetched again.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if libs="$(cached_libs_dir)"; then
    echo "kafka: jars cached in $libs"
    exit 0
fi
require_mvn

candidates=("${KAFKA_VERSIONS[@]}")
if [[ -n "${K3_KAFKA_VERSION:-}" ]]; then candidates=("$K3_KAFKA_VERSION"); fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

write_pom() {
    cat >"$work/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>k3.local</groupId>
  <artifactId>kafka-broker-classpath</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$1</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j2-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <!-- Kafka's POM pins slf4j-api 1.7, which cannot see an slf4j2 provider (logging would go nowhere);
         declaring 2.x here wins Maven's nearest-first resolution, and 2.x serves 1.7 callers unchanged. -->
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-api</artifactId>
      <version>$SLF4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
}

for version in "${candidates[@]}"; do
    dest="$K3_CACHE/kafka-$version"
    echo "kafka: fetching org.apache.kafka:kafka_2.13:$version and its runtime dependencies from Maven Central"
    write_pom "$version"
    rm -rf "$dest/libs.partial"
    mkdir -p "$dest"
    if mvn -B -q -f "$work/pom.xml" -Dmaven.repo.local="$K3_CACHE/m2" \
        dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$dest/libs.partial" \
        >"$work/mvn.log" 2>&1; then
        rm -rf "$dest/libs"
        mv "$dest/libs.partial" "$dest/libs"
        echo "$version" >"$dest/.complete"
        echo "kafka: $(ls "$dest/libs" | wc -l) jars in $dest/libs"
        exit 0
    fi
    rm -rf "$dest/libs.partial"
    rmdir "$dest" 2>/dev/null || true
    echo "kafka: version $version could not be resolved:" >&2
    grep -E '^\[ERROR\]' "$work/mvn.log" | head -n 3 >&2 || tail -n 5 "$work/mvn.log" >&2
done
die "no Kafka version out of ${candidates[*]} could be fetched (is Maven Central reachable?)"
