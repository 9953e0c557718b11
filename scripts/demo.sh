#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the built-in default:
# the codec tour (every compressor on a real MLP gradient from Fashion-MNIST).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
exec "$BUILD_DIR/bin/sparrow-codec" tour "$@"
