#!/usr/bin/env bash
# Installs what is missing, builds, and runs the tests.
#   scripts/test.sh           the default suite (everything not labelled slow)
#   scripts/test.sh --slow    only the slow tests
#   scripts/test.sh --all     everything
#   scripts/test.sh --sanitize  the default suite on an ASan + UBSan build of
#                               everything, in build-sanitize/ (clang when
#                               installed, else g++; ~15-25 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-default}
scripts/setup.sh
# The Python package's tests (docs/python.md) need pybind11 and python3-torch.
scripts/setup.sh --python
# The browser tests (labelled slow) drive a headless Chromium; the lite
# runtime's arm64 test (slow) a cross compiler and qemu-user.
if [[ "$mode" == --slow || "$mode" == --all ]]; then scripts/setup.sh --browser; scripts/setup.sh --arm64; fi
if [[ "$mode" == --sanitize ]]; then
  cxx=g++
  if command -v clang++ >/dev/null; then cxx=clang++; fi
  san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B build-sanitize -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" \
    -DSPARROW_BUILD_BENCH=OFF -DSPARROW_CUDA=OFF
  cmake --build build-sanitize -j "$(nproc)"
  # LibTorch keeps allocations alive at exit: leaks are not what this looks for.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  exec ctest --test-dir build-sanitize --output-on-failure -j 2 -LE slow
fi
scripts/build.sh
BUILD_DIR=${SPARROW_BUILD_DIR:-build}
# ctest runs two test processes at once: one compute thread each (ATen's OpenMP
# pool and OpenBLAS's pthreads), or the pools spin against each other on 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
case "$mode" in
  default) ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 -LE slow ;;
  --slow)  ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 -L slow ;;
  --all)   ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 ;;
  *) echo "usage: scripts/test.sh [--slow|--all|--sanitize]" >&2; exit 2 ;;
esac
