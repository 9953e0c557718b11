#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the built-in default:
# the DGC simulation (examples/dgc_mnist.toml: 1,000 stateful Fashion-MNIST clients,
# 99.9% sparse updates), then plots it. Extra arguments go to sparrow-sim
# (e.g. --set rounds=20). `build/bin/sparrow-codec tour` shows every compressor
# on a real gradient.
#
# SPARROW_QUICK=1: the small settings the README's test runs the quick start
# with: 2 rounds instead of 100, and no install or build step when
# $SPARROW_BUILD_DIR/bin/sparrow-sim is already built.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
QUICK=()
if [[ "${SPARROW_QUICK:-0}" == 1 ]]; then QUICK=(--set rounds=2); fi
if [[ ${#QUICK[@]} -eq 0 || ! -x "$BUILD_DIR/bin/sparrow-sim" ]]; then
  scripts/setup.sh
  scripts/build.sh >/dev/null
fi
"$BUILD_DIR/bin/sparrow-sim" --config examples/dgc_mnist.toml --force "${QUICK[@]}" "$@"
"$BUILD_DIR/bin/sparrow-sim" report runs/dgc_mnist >&2
