#!/usr/bin/env bash
# Checks the prerequisites of start.sh without starting anything: Java 17+, and Maven unless the jars are
# already cached. With --cached the jars must be cached (for callers that must not download, like tests).
# Exit status 2 with one line on stderr when something is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_java
if ! cached_libs_dir >/dev/null; then
    if [[ "${1:-}" == "--cached" ]]; then
        die_missing "the Kafka jars are not cached in $K3_CACHE; fetch them with ops/kafka/fetch.sh"
    fi
    require_mvn
fi
