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
#   scripts/setup.sh --arm64   also the arm64 cross compiler, qemu-user and the arm64
#                              (Debian multiarch) libraries of the networked lite
#                              client, for the arm64 tests (docs/lite.md; about 125 MB
#                              to fetch, 480 MB installed; --slow and --all install it)
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
# The arm64 cross-build (cmake/aarch64-linux-gnu.cmake): the cross compiler,
# qemu-user to run what it builds, and the arm64 builds of the networked lite
# client's libraries through Debian multiarch (the :arm64 packages install
# into /usr/lib/aarch64-linux-gnu beside the host's; flatc stays the host's).
# Multiarch packages must have the same version as the host's copy: apt may
# upgrade a few host packages (libssl3, liblzma5...) to match the archive.
# Without the :arm64 libraries the arm64 build is the lite runtime only.
ARM64_LIBS=(libzmq3-dev:arm64 libsodium-dev:arm64 libspdlog-dev:arm64 libfmt-dev:arm64
            libtomlplusplus-dev:arm64 libflatbuffers-dev:arm64)
if [[ "${1:-}" == "--arm64" ]]; then PACKAGES+=(g++-aarch64-linux-gnu qemu-user "${ARM64_LIBS[@]}"); fi

# dpkg-query prints one line per installed architecture of a package: a name
# without :ARCH asks for the host's copy (or an architecture-independent one),
# not an arm64 copy that --arm64 installed beside it.
native=$(dpkg --print-architecture)
missing=()
for p in "${PACKAGES[@]}"; do
  if [[ "$p" == *:* ]]; then want='^[^ ]+ install ok installed$'; else want="^($native|all) install ok installed$"; fi
  dpkg-query -W -f='${Architecture} ${Status}\n' "$p" 2>/dev/null | grep -Eq "$want" || missing+=("$p")
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
if [[ "${missing[*]}" == *:arm64* ]] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
