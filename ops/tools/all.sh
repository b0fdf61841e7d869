#!/usr/bin/env bash
# Builds (or finds cached) every tool the deployment tests use: helm, KubeRay's CRDs, etcd, kube-apiserver.
# Each script returns at once when its cached result is there; a first run compiles for a long while.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for tool in helm kuberay-crds etcd kube-apiserver; do
    echo "tools: $tool -> $(bash "$here/$tool.sh")"
done
