#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs the unit and integration
# tests (tests/) and the end-to-end tests (e2e/) on a real Kubernetes cluster.
#
#   bash tools/test.sh                   mypy over src/, tests/, then e2e/ on a local single-node cluster that
#                                        this script brings up (tools/cluster/up.sh) and tears down after
#   KUBECONFIG=... bash tools/test.sh    tests/, then e2e/ on that cluster (set IMESH_E2E_* images)
#   IMESH_E2E=0 bash tools/test.sh       tests/ only
#   bash tools/test.sh fast              the fast tier (tests/conftest.py FAST_TIER: unit and in-process
#                                        tests, no processes), then mypy: a few minutes, while changing code
#   bash tools/test.sh tests/test_x.py   only what you name (no cluster)
#
# Idempotent and cached: a second run installs nothing and reuses the Kubernetes binaries, the
# base image and unchanged images.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Python: the project and its test extras, as a regular (not editable) install, the way users
# get it: the tests import the installed package (src/ keeps the clone's root from shadowing it).
# torch is pinned to the CPU build available on these machines (a looser requirement would
# download CUDA packages).
python3 -m pip install -q "torch==2.13.0" ".[test]"

PYTEST=(python3 -m pytest -q -p no:cacheprovider --durations=15)
# The fast tier starts no processes: it needs neither promtool nor Kubernetes.
if [ "${1:-}" = fast ]; then
  shift
  t0=$(date +%s)
  fast=0
  "${PYTEST[@]}" --fast tests "$@" || fast=$?
  echo "[test.sh] fast tier took $(( $(date +%s) - t0 ))s" >&2
  python3 -m mypy
  exit "$fast"
fi

# promtool (Prometheus' own metrics linter) for the /metrics tests.
if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi

# etcd + the Kubernetes binaries for the operator tests and the local cluster (built once, cached).
bash tools/k8s/ensure_binaries.sh

if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi

# The type checker over src/ (its settings: pyproject.toml's [tool.mypy]; only the generated protobuf code is exempt).
python3 -m mypy

# Two runs, not one: the operator tests point KUBECONFIG at control planes of their own for the
# whole session, and the unit tests should not share the two cores with a running cluster.
t0=$(date +%s)
unit=0
"${PYTEST[@]}" tests || unit=$?
echo "[test.sh] tests/ took $(( $(date +%s) - t0 ))s" >&2
if [ "${IMESH_E2E:-1}" = 0 ]; then
  exit "$unit"
fi
if [ -z "${KUBECONFIG:-}" ]; then
  started=$(date +%s)
  trap 'bash tools/cluster/down.sh >&2 || true' EXIT
  eval "$(bash tools/cluster/up.sh | grep '^export ')"
  echo "[test.sh] local cluster ready in $(( $(date +%s) - started ))s" >&2
fi
t0=$(date +%s)
e2e=0
"${PYTEST[@]}" e2e || e2e=$?
echo "[test.sh] e2e/ took $(( $(date +%s) - t0 ))s" >&2
down=0
if [ -n "${started:-}" ]; then
  # The teardown is checked too: down.sh fails when anything it added is left (routes, iptables
  # tables, files); then no cluster range may keep an unreachable route.
  trap - EXIT
  bash tools/cluster/down.sh >&2 || down=$?
  left=$(IMESH_CLUSTER_SNAPSHOTTER=native bash -c 'source tools/cluster/lib.sh && missing_unreachable_routes' | wc -w)
  [ "$left" = 2 ] || { echo "[test.sh] down.sh left cluster routes behind" >&2; down=1; }
fi
echo "[test.sh] tests/ exit $unit, e2e/ exit $e2e, cluster teardown exit $down" >&2
[ "$unit" = 0 ] && [ "$e2e" = 0 ] && [ "$down" = 0 ]
