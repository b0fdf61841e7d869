#!/usr/bin/env bash
# Builds the Helm CLI from its Go module (helm.sh/helm/v3/cmd/helm at $HELM_VERSION) into
# $K3_CACHE/bin/helm-<version> and prints that path. A cached binary is reused without touching the network.
#
# `go install module/cmd@version` builds exactly the versions the module's own go.mod pins (Helm has no
# replace directives), so the binary is the released Helm, only compiled here. The version is stamped in
# through the linker flag Helm's release builds use, so `helm version` reports it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if path="$(cached_tool helm "$HELM_VERSION")"; then
    echo "$path"
    exit 0
fi
require_go

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "tools: building helm $HELM_VERSION from helm.sh/helm/v3 (takes several minutes)" >&2
GOBIN="$work" CGO_ENABLED=0 nice -n "$K3_BUILD_NICE" go install -p "$K3_GO_BUILD_P" \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2 \
    || die "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION failed (is the Go module proxy reachable?)"
version="$("$work/helm" version --template '{{.Version}}')"
[[ "$version" == "$HELM_VERSION" ]] || die "built helm reports version '$version', expected $HELM_VERSION"
install_tool "$work/helm" helm "$HELM_VERSION"
