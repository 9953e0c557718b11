#!/usr/bin/env bash
# Installs the Debian packages Sparrow's build, tests and demo need.
# Does nothing when they are all present. Uses sudo when not root.
#   scripts/setup.sh           build, tests, demo
#   scripts/setup.sh --bench   also python3-torch, the plain-PyTorch peer of
#                              `sparrow-bench sim` (bench/peer_fedavg.py)
#   scripts/setup.sh --python  also the Python package's build and test needs
#                              (pybind11, python3-dev, python3-torch)
#   scripts/setup.sh --fuzz    also clang (libFuzzer, ASan, UBSan) for scripts/fuzz.sh
#   scripts/setup.sh --browser also chromium, for the dashboard's browser tests
#                              (scripts/test.sh --slow and --all install it)
#   scripts/setup.sh --arm64   also the arm64 cross compiler and qemu-user, for the
#                              lite runtime's arm64 test (docs/lite.md; about 68 MB
#                              to fetch, 320 MB installed; --slow and --all install it)
set -euo pipefail

PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev            # LibTorch (ATen, torch::nn)
  libflatbuffers-dev flatbuffers-compiler   # wire format
  doctest-dev             # tests
  libcli11-dev            # command lines
  zlib1g-dev              # gzipped IDX datasets
  libsqlite3-dev          # state store (client state, runs)
  libtomlplusplus-dev     # simulator experiment configs (TOML)
  dataset-fashion-mnist   # the real data set (/usr/share/datasets/fashion-mnist)
  libzmq3-dev cppzmq-dev  # server/client/edge transport (ZeroMQ, CurveZMQ)
  libsodium-dev           # CurveZMQ's crypto (libzmq links it)
  libspdlog-dev           # structured logs of the server and clients
  # An optimised BLAS for LibTorch's GEMMs: Debian's LibTorch calls the generic
  # libblas.so.3, which is otherwise the netlib reference BLAS (~8x slower).
  # OpenBLAS over BLIS by measurement on the 2-core CI machine (AMD Zen 5):
  # 42-166 GFLOP/s against 12-15 for BLIS 0.9 (docs/performance.md).
  libopenblas0-pthread
  # JIT small-GEMM kernels for the built-in models' CPU training step
  # (core/linear_cpu.h): 1.15-1.5x OpenBLAS on batch-32 Linear layers.
  libxsmm-dev
  # The live dashboard (docs/monitoring.md): its HTTP server and the charts,
  # embedded in the binaries at build time.
  libcpp-httplib-dev libjs-chart.js
  # sparrow-sim over several MPI ranks (mpirun -np R; docs/simulator.md)
  libopenmpi-dev openmpi-bin
  # The LibTorch-free device runtime's math (lite/, docs/lite.md): header-only.
  libeigen3-dev
)
if [[ "${1:-}" == "--bench" ]]; then PACKAGES+=(python3-torch); fi
# The Python package (docs/python.md): pybind11, Python's headers and Debian's
# PyTorch on the same LibTorch, so tensors cross without copies. Not for the
# demo: python3-torch and what it pulls are about 140 MB more; the build skips
# the package when they are missing.
if [[ "${1:-}" == "--python" ]]; then PACKAGES+=(pybind11-dev python3-pybind11 python3-dev python3-torch); fi
if [[ "${1:-}" == "--fuzz" ]]; then PACKAGES+=(clang); fi
if [[ "${1:-}" == "--browser" ]]; then PACKAGES+=(chromium); fi
if [[ "${1:-}" == "--arm64" ]]; then PACKAGES+=(g++-aarch64-linux-gnu qemu-user); fi

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup.sh: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "setup.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
