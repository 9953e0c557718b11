#!/usr/bin/env bash
# Installs what is missing, builds, and runs the tests.
#   scripts/test.sh           the default suite (everything not labelled slow)
#   scripts/test.sh --slow    only the slow tests
#   scripts/test.sh --all     everything
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-default}
scripts/setup.sh
scripts/build.sh
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
# ctest runs two test processes at once: one compute thread each (ATen's OpenMP
# pool and OpenBLAS's pthreads), or the pools spin against each other on 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
case "$mode" in
  default) ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 -LE slow ;;
  --slow)  ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 -L slow ;;
  --all)   ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 ;;
  *) echo "usage: scripts/test.sh [--slow|--all]" >&2; exit 2 ;;
esac
