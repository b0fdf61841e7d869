#!/usr/bin/env bash
# Checks that redis-server is installed; exit status 2 with one line on stderr when it is not.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_redis
