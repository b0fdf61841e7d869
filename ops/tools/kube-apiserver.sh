#!/usr/bin/env bash
# Builds kube-apiserver from the Go module k8s.io/kubernetes (cmd/kube-apiserver at $KUBERNETES_VERSION)
# into $K3_CACHE/bin/kube-apiserver-<version> and prints that path. A cached binary is reused.
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/apiserver, ...) at v0.0.0 and replaces
# them with ./staging directories that its module zip does not contain, so neither `go install` nor a build
# inside the downloaded module works. A throw-away module that requires k8s.io/kubernetes and replaces every
# staging module with its published release (v1.X.Y -> v0.X.Y, the same source) builds the real binary.
# The list of staging modules is read from k8s.io/kubernetes' own go.mod, so it follows the release.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if path="$(cached_tool kube-apiserver "$KUBERNETES_VERSION")"; then
    echo "$path"
    exit 0
fi
require_go

staging_version="v0.${KUBERNETES_VERSION#v1.}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "tools: building kube-apiserver $KUBERNETES_VERSION from k8s.io/kubernetes (takes a long while)" >&2
(
    cd "$work"
    gomod="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')"
    [[ -f "$gomod" ]] || { echo "tools: go mod download k8s.io/kubernetes@$KUBERNETES_VERSION gave no go.mod" >&2; exit 1; }
    go mod init k3.local/kube-apiserver-build >/dev/null 2>&1
    go mod edit -require "k8s.io/kubernetes@$KUBERNETES_VERSION"
    staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/.*#\1#p' "$gomod")"
    [[ -n "$staging" ]] || { echo "tools: no staging replace directives found in $gomod" >&2; exit 1; }
    for module in $staging; do
        go mod edit -replace "$module=$module@$staging_version"
    done
    # The throw-away module imports nothing itself; -mod=mod lets the build record what it resolves.
    CGO_ENABLED=0 nice -n "$K3_BUILD_NICE" go build -mod=mod -p "$K3_GO_BUILD_P" -trimpath \
        -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$KUBERNETES_VERSION")" \
        -o kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver >&2
) || die "building k8s.io/kubernetes/cmd/kube-apiserver@$KUBERNETES_VERSION failed"
version="$("$work/kube-apiserver" --version | awk '{print $2}')"
[[ "$version" == "$KUBERNETES_VERSION" ]] || die "built kube-apiserver reports version '$version', expected $KUBERNETES_VERSION"
install_tool "$work/kube-apiserver" kube-apiserver "$KUBERNETES_VERSION"
