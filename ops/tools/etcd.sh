#!/usr/bin/env bash
# Builds etcd from its Go module (go.etcd.io/etcd/server/v3 at $ETCD_VERSION, whose root package is the
# etcd server's main) into $K3_CACHE/bin/etcd-<version> and prints that path. A cached binary is reused.
#
# etcd's go.mod replaces its sibling modules (api, client, pkg) with local directories, which makes
# `go install module@version` refuse it. Building the package from a throw-away module that requires it
# works instead: replace directives of a dependency are ignored, and the versions its go.mod requires are
# the released sibling modules of the same etcd release.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if path="$(cached_tool etcd "$ETCD_VERSION")"; then
    echo "$path"
    exit 0
fi
require_go

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "tools: building etcd $ETCD_VERSION from go.etcd.io/etcd/server/v3 (takes several minutes)" >&2
(
    cd "$work"
    go mod init k3.local/etcd-build >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
    CGO_ENABLED=0 nice -n "$K3_BUILD_NICE" go build -p "$K3_GO_BUILD_P" -trimpath -ldflags "-s -w" -o etcd go.etcd.io/etcd/server/v3 >&2
) || die "building go.etcd.io/etcd/server/v3@$ETCD_VERSION failed (is the Go module proxy reachable?)"
version="$("$work/etcd" --version | sed -n 's/^etcd Version: //p')"
[[ "v$version" == "$ETCD_VERSION" ]] || die "built etcd reports version '$version', expected $ETCD_VERSION"
install_tool "$work/etcd" etcd "$ETCD_VERSION"
