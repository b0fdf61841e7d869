#!/usr/bin/env bash
# Puts KubeRay's CRDs (RayCluster, RayJob) for $KUBERAY_VERSION into $K3_CACHE/kuberay-crds-<version> and
# prints that directory. They come with the Go module github.com/ray-project/kuberay/ray-operator, whose
# config/crd/bases holds the CRDs generated from its API types; the offline validator (kube_validate.py)
# checks the chart's ray.io/v1 objects against their schemas and the API-server test installs them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest="$K3_CACHE/kuberay-crds-$KUBERAY_VERSION"
if [[ -f "$dest/.complete" ]]; then
    echo "$dest"
    exit 0
fi
require_go

module="github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
dir="$(cd "$(mktemp -d)" && go mod download -json "$module" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')" \
    || die "go mod download $module failed (is the Go module proxy reachable?)"
[[ -d "$dir/config/crd/bases" ]] || die "$module has no config/crd/bases"
rm -rf "$dest"
mkdir -p "$dest"
for kind in rayclusters rayjobs; do
    cp "$dir/config/crd/bases/ray.io_$kind.yaml" "$dest/"
done
chmod u+w "$dest"/*.yaml
touch "$dest/.complete"
echo "$dest"
