#!/usr/bin/env bash
# Configures and builds Sparrow into build/ (binaries in build/bin/).
# Extra arguments go to CMake's configure step, e.g. -DSPARROW_CUDA=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
GEN=()
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]] && command -v ninja >/dev/null; then GEN=(-G Ninja); fi
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
