#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the built-in default:
# the DGC simulation (examples/dgc_mnist.toml: 1,000 stateful Fashion-MNIST clients,
# 99.9% sparse updates), then plots it. Extra arguments go to sparrow-sim
# (e.g. --set rounds=20). `build/bin/sparrow-codec tour` shows every compressor
# on a real gradient.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
"$BUILD_DIR/bin/sparrow-sim" --config examples/dgc_mnist.toml --force "$@"
"$BUILD_DIR/bin/sparrow-sim" report runs/dgc_mnist >&2
