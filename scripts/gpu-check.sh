#!/usr/bin/env bash
# Builds Sparrow with CUDA on a GPU machine and runs the CUDA tests and the GPU
# benchmarks (docs/gpu.md, docs/performance.md "On a GPU"). Made for a bare
# machine with PyTorch (whose LibTorch Sparrow links), nvcc, cmake and ninja:
# the other dependencies come as Debian packages in .debs (unpacked into
# /opt/deps, never /), Fashion-MNIST in .data/fashion-mnist; `--fetch`, run on
# Debian, prepares both. Every step is time-boxed and logs to $OUT (default
# ./gpu-out), so a failed step still leaves what came before.
#
#   scripts/gpu-check.sh --fetch                      (here: .debs and .data)
#   scripts/gpu-check.sh [--tests-only] [--ctest] [--all] [--bench-args "..."]
#     --ctest: build everything and run the whole suite (ctest -LE slow); no benchmarks
#     --all: the CUDA tests and the benchmarks first (four targets), then the
#            rest of the build and the whole suite in the time that is left
#   env: GPU_CHECK_SECONDS (540), GPU_CHECK_BENCH_SECONDS (the sim benchmark's cap),
#        GPU_CHECK_TARGETS, GPU_CHECK_GDB=1 (backtraces)
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${GPU_CHECK_SECONDS:-540}  # the whole script; the sim benchmark gets what is left
left() { echo $((budget - ($(date +%s) - t0))); }
log() { echo "[gpu-check +$(($(date +%s) - t0))s] $*" | tee -a "$out/steps.txt"; }
tests_only=0
full_ctest=0
staged=0
bench_args="--models mlp,cnn --mlp-rounds 20 --cnn-rounds 3 --population 10000 --per-round 100 --population-rounds 4"
fetch() {
  # The -dev packages the build needs, their runtime libraries, pkgconf, and
  # Chart.js for the dashboard (sparrow_monitor is built with everything).
  local pkgs=(libzmq3-dev libzmq5 libsodium23 libsodium-dev libpgm-5.3-0 libpgm-dev libnorm1 libnorm-dev
    libbsd0 libmd0 cppzmq-dev libflatbuffers-dev libflatbuffers2 flatbuffers-compiler libsqlite3-dev
    libsqlite3-0 doctest-dev libcli11-dev libtomlplusplus-dev libtomlplusplus3 libspdlog-dev libspdlog1.10
    libfmt-dev libfmt9 nlohmann-json3-dev zlib1g-dev pkgconf pkgconf-bin libpkgconf3 libcpp-httplib-dev
    libcpp-httplib0.11 libbrotli1 libbrotli-dev libjs-chart.js)
  mkdir -p .debs .data
  (cd .debs && for p in "${pkgs[@]}"; do apt-get download "$p" >/dev/null 2>&1 || echo "not downloaded: $p" >&2; done)
  cp -r /usr/share/datasets/fashion-mnist .data/
  grep -qx "/.data/" .git/info/exclude 2>/dev/null || echo "/.data/" >>.git/info/exclude
  echo "gpu-check: $(ls .debs | wc -l) packages in .debs, Fashion-MNIST in .data: carry both"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --fetch) fetch; exit 0 ;;
    --tests-only) tests_only=1 ;;
    --ctest) full_ctest=1; tests_only=1 ;;  # the whole suite takes the time the benchmarks would
    --all) staged=1 ;;
    --bench-args) bench_args=$2; shift ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

# Dependencies: the .debs unpacked into /opt/deps and put on the search paths
# (next to PyTorch's LibTorch), pkg-config from them when the machine has none,
# and no Requires.private in their .pc files (krb5-gssapi, openpgm, openssl...
# ship no .pc there; only static links need them).
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
export CMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:+$CMAKE_PREFIX_PATH:}$torch_prefix"
if [ -d .debs ]; then
  mkdir -p /opt/deps
  for f in .debs/*.deb; do dpkg -x "$f" /opt/deps; done
  export CMAKE_PREFIX_PATH="/opt/deps/usr:/opt/deps/usr/lib/x86_64-linux-gnu/cmake:/opt/deps/usr/share/cmake:$CMAKE_PREFIX_PATH"
  export PKG_CONFIG_PATH="/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR=/opt/deps
  export LD_LIBRARY_PATH="/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  export PATH="/opt/deps/usr/bin:$PATH"
  export CPATH="/opt/deps/usr/include:${CPATH:-}"
  sed -i '/^Requires.private/d' /opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  command -v pkg-config >/dev/null || ln -sf /opt/deps/usr/bin/pkgconf /opt/deps/usr/bin/pkg-config
  # zlib1g-dev's libz.so points at a zlib1g that is not carried: use the machine's.
  zso=/opt/deps/usr/lib/x86_64-linux-gnu/libz.so
  [ -e "$zso" ] || ln -sf "$(ls /lib/x86_64-linux-gnu/libz.so.1 /usr/lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)" "$zso"
fi
if [ -d .data/fashion-mnist ] && [ ! -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r .data/fashion-mnist /usr/share/datasets/
fi
export PATH="$PATH:/usr/local/cuda/bin"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >>"$out/steps.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch.compiled_with_cxx11_abi())' \
  2>&1 | tee -a "$out/steps.txt"
nproc | tee -a "$out/steps.txt"
torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')

# LibTorch 2.12 and later refuse C++17: probe the installed headers.
std=17
printf '#include <ATen/ATen.h>\nint main() { return 0; }\n' >/tmp/std_probe.cc
if ! g++ -std=c++17 -fsyntax-only -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include" \
  /tmp/std_probe.cc >/dev/null 2>&1; then
  std=20
fi
log "C++ standard $std; $(command -v g++): $(g++ --version | head -1); nvcc $(nvcc --version | tail -1)"

build=build-gpu
chartjs=""  # Chart.js from the carried libjs-chart.js (monitor/CMakeLists.txt looks in /usr/share only)
[ -f /opt/deps/usr/share/javascript/chart.js/chart.min.js ] &&
  chartjs="-DSPARROW_CHARTJS=/opt/deps/usr/share/javascript/chart.js/chart.min.js"
log "configure"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSPARROW_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
  -DCMAKE_CXX_STANDARD=$std -DSPARROW_MPI=OFF -DSPARROW_CCACHE=OFF $chartjs -DSPARROW_INCLUDE_FIRST=/opt/deps/usr/include \
  -DCMAKE_CXX_FLAGS="-include cstdint" -DCMAKE_EXE_LINKER_FLAGS="-Wl,--no-as-needed" >"$out/build.log" 2>&1 ||
  { log "configure failed"; tail -40 "$out/build.log"; exit 1; }
grep -E "sparrow:" "$out/build.log"
log "build"
targets=${GPU_CHECK_TARGETS:-"sparrow-bench sparrow_client_tests sparrow_compression_tests sparrow_sim_tests"}
[ "$full_ctest" = 1 ] && targets=""  # everything
# A machine kept warm keeps build-gpu: no binary of an earlier build may pass
# for this one's.
rm -f "$build"/bin/sparrow-bench "$build"/bin/sparrow_*_tests
# shellcheck disable=SC2086
timeout 330 ninja -C "$build" -k 0 $targets >>"$out/build.log" 2>&1
rc=$?
log "build rc=$rc"
grep -E "error:|FAILED" "$out/build.log" | head -40

for b in "$build"/bin/sparrow_*_tests; do
  [ -x "$b" ] || continue
  readelf -d "$b" | grep -q "NEEDED.*libstdc++" || log "warning: $b does not link libstdc++.so"
  break
done

run_test() {  # binary, doctest filter
  [ -x "$build/bin/$1" ] || { log "$1 not built"; return; }
  if [ "${GPU_CHECK_GDB:-0}" = 1 ]; then  # a crash's backtrace (cuda-gdb debugs host code too)
    timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info threads" --args "$build/bin/$1" -tc="$2" 2>&1 | tail -c 20000 >/tmp/test.log
  else
    timeout 90 "$build/bin/$1" -tc="$2" 2>&1 | tail -c 20000 >/tmp/test.log
  fi
  log "$1 -tc=$2: rc=${PIPESTATUS[0]} $(grep -E 'test cases:' /tmp/test.log)"
  cat /tmp/test.log >>"$out/tests.log"
  grep -E "ERROR|skipped|FAILED" /tmp/test.log | head -20
}
run_test sparrow_compression_tests "cuda*"
run_test sparrow_client_tests "*batched*"
run_test sparrow_sim_tests "*CUDA*"
whole_suite() {  # seconds
  log "ctest -LE slow (${1}s)"
  # One compute thread per test process, as scripts/test.sh: the wheel's
  # OpenMP pools of 16 threads in 12 processes at once made eight simulator
  # tests run past 120 s on the first try.
  (cd "$build" && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout "$1" \
    ctest -LE slow -j "$(nproc)" --timeout 120 --output-on-failure >"$out/ctest.log" 2>&1)
  log "ctest rc=$?"
  grep -E "tests passed|Failed|Timeout|\*\*\*" "$out/ctest.log" | tail -40
}
if [ "$full_ctest" = 1 ]; then
  t=$(($(left) - 5))
  [ "$t" -gt 20 ] || t=20
  whole_suite "$t"
fi
[ "$tests_only" = 1 ] && exit 0

if [ -x "$build/bin/sparrow-bench" ]; then
  log "bench compress --device cuda"
  # d2d_copy, torch_topk, dgc (encode with its one wait), sign, dgc_device and
  # dgc_device_fold (the device-level encode, no wait inside a call).
  timeout 60 "$build/bin/sparrow-bench" compress --device cuda --elements 25000000 --repeat 5 2>>"$out/bench.err" |
    grep "^{" | tee "$out/bench_compress.jsonl"
  log "bench sim --cases gpu $bench_args"
  t=$(left)
  cap=${GPU_CHECK_BENCH_SECONDS:-$t}  # --all: leave the rest to the whole suite
  [ "$t" -gt "$cap" ] && t=$cap
  [ "$t" -gt 30 ] || t=30
  # shellcheck disable=SC2086
  timeout "$t" "$build/bin/sparrow-bench" sim --cases gpu $bench_args --tmp /tmp/sparrow-bench 2>>"$out/bench.err" |
    grep "^{" | tee "$out/bench_sim_gpu.jsonl"
  log "bench rc=${PIPESTATUS[0]}"
  tail -5 "$out/bench.err"
fi
if [ "$staged" = 1 ]; then
  log "build everything ($(left)s left)"
  tb=$(($(left) - 60))
  [ "$tb" -gt 30 ] || tb=30
  timeout "$tb" ninja -C "$build" -k 0 >>"$out/build.log" 2>&1
  log "build rc=$?"
  grep -E "error:|FAILED" "$out/build.log" | head -40
  t=$(($(left) - 10))
  [ "$t" -gt 20 ] && whole_suite "$t"
fi
log "done"
