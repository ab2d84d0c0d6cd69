#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs the whole suite.
# Idempotent and cached: a second run installs nothing and reuses the Kubernetes binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Python: the project and its test extras, as a regular (not editable) install, the way users
# get it: the tests import the installed package (src/ keeps the clone's root from shadowing it).
# torch is pinned to the CPU build available on these machines (a looser requirement would
# download CUDA packages).
python3 -m pip install -q "torch==2.13.0" ".[test]"

# promtool (Prometheus' own metrics linter) for the /metrics tests.
if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi

# etcd + kube-apiserver + kube-controller-manager for the operator tests (built once, cached).
bash tools/k8s/ensure_binaries.sh

exec python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
