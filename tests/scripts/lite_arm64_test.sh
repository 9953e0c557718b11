#!/usr/bin/env bash
# The lite runtime cross-built for arm64 and run under qemu-user (docs/lite.md,
# "arm64"), against the x86-64 build it is given:
#   lite_arm64_test.sh SOURCE_DIR BUILD_DIR
# 1. configures SOURCE_DIR/build-arm64 (SPARROW_LITE_ONLY, the aarch64
#    toolchain file; SPARROW_ARM64_BUILD_DIR overrides the folder), builds the
#    runtime's targets there and runs its torch-free tests under qemu-aarch64
#    (the networked client's targets in the same folder are
#    lite_client_arm64_test.sh's);
# 2. checks that the arm64 sparrow-lite-train needs no shared library beyond
#    libc, libm, libstdc++, libgcc_s and the dynamic loader;
# 3. trains the MLP and the CNN (exported by BUILD_DIR's sparrow-lite-export)
#    for a few epochs, one process per epoch through the model file, with the
#    arm64 binary under qemu and with BUILD_DIR's x86-64 binary: the loss
#    must fall epoch by epoch, and the two builds must agree on every epoch's
#    loss and on the trained weights within float rounding.
# Installs nothing: exits 77 (CTest: skipped) without the cross compiler or
# qemu-user; scripts/setup.sh --arm64 installs both.
set -euo pipefail
src=$(cd "$1" && pwd)
bin=$(cd "$2" && pwd)/bin
arm=${SPARROW_ARM64_BUILD_DIR:-$src/build-arm64}

for tool in aarch64-linux-gnu-g++ aarch64-linux-gnu-readelf qemu-aarch64; do
  if ! command -v "$tool" >/dev/null; then
    echo "lite_arm64: SKIPPED: $tool is not installed (scripts/setup.sh --arm64 installs g++-aarch64-linux-gnu and qemu-user)"
    exit 77
  fi
done
for prog in sparrow-lite-export sparrow-lite-train; do
  [[ -x "$bin/$prog" ]] || { echo "lite_arm64: FAIL: $bin/$prog not built" >&2; exit 1; }
done
# The cross compiler's libc and libstdc++ even where Debian's multiarch arm64
# libc is installed too (cmake/aarch64-linux-gnu.cmake says why).
qemu=(qemu-aarch64 -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)

# 1. The cross-build of the runtime and its unit tests under qemu.
gen=()
if [[ ! -f "$arm/CMakeCache.txt" ]] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
cmake -S "$src" -B "$arm" "${gen[@]}" -DCMAKE_TOOLCHAIN_FILE="$src/cmake/aarch64-linux-gnu.cmake" \
  -DSPARROW_LITE_ONLY=ON >/dev/null
cmake --build "$arm" -j 2 --target sparrow-lite-train sparrow_lite_portable_tests
"${qemu[@]}" "$arm/bin/sparrow_lite_portable_tests"
train_arm=$arm/bin/sparrow-lite-train
aarch64-linux-gnu-readelf -h "$train_arm" | grep -q 'Machine:.*AArch64' ||
  { echo "lite_arm64: FAIL: $train_arm is not an aarch64 binary" >&2; exit 1; }

# 2. Footprint: the binary and what it needs.
needed=$(aarch64-linux-gnu-readelf -d "$train_arm" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "lite_arm64: sparrow-lite-train $(stat -c %s "$train_arm") bytes, needs: $needed"
for lib in $needed; do
  case "$lib" in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|ld-linux-aarch64.so.*) ;;
    *) echo "lite_arm64: FAIL: the arm64 sparrow-lite-train needs $lib" >&2; exit 1 ;;
  esac
done

# 3. Training, arm64 under qemu against x86-64 natively.
work=$(mktemp -d "$PWD/lite_arm64_XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
"$bin/sparrow-lite-export" --model mlp --seed 1 -o mlp.lite >/dev/null
"$bin/sparrow-lite-export" --model cnn --seed 1 -o cnn.lite >/dev/null

# chain ARCH MODEL SAMPLES EPOCHS: one epoch per process, each starting from
# the last one's model file (same synthetic data: same seed); prints the losses.
chain() {
  local arch=$1 model=$2 samples=$3 epochs=$4 run
  if [[ $arch == arm64 ]]; then run=("${qemu[@]}" "$train_arm"); else run=("$bin/sparrow-lite-train"); fi
  cp "$model.lite" "$model.$arch.lite"
  for ((e = 0; e < epochs; ++e)); do
    "${run[@]}" "$model.$arch.lite" --samples "$samples" --lr 0.05 --momentum 0.9 --seed 3 \
      -o "$model.$arch.lite" > "$model.$arch.$e.json"
    sed -n 's/.*"mean_loss": \([0-9.eE+-]*\).*/\1/p' "$model.$arch.$e.json"
  done
}

status=0
check() {  # MODEL SAMPLES EPOCHS
  local model=$1 samples=$2 epochs=$3
  local x86 arm
  x86=$(chain x86-64 "$model" "$samples" "$epochs" | tr '\n' ' ')
  arm=$(chain arm64 "$model" "$samples" "$epochs" | tr '\n' ' ')
  echo "lite_arm64: $model losses by epoch: x86-64 [$x86] arm64 [$arm]"
  echo "lite_arm64: $model arm64 under qemu: $(sed -n 's/.*\("samples_per_s": [0-9.]*\).*\("peak_rss_mb": [0-9.]*\).*/\1, \2/p' "$model.arm64.0.json")"
  # Python's float parsing keeps the comparison exact where awk's would not.
  python3 - "$model" "$x86" "$arm" <<'EOF' || status=1
import struct, sys
model, x86, arm = sys.argv[1], [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
ok = True
for name, losses in (("x86-64", x86), ("arm64", arm)):
    if any(b >= a for a, b in zip(losses, losses[1:])) or losses[-1] > losses[0] - 0.02:
        print(f"lite_arm64: FAIL: {model} on {name}: the loss does not fall epoch by epoch: {losses}")
        ok = False
worst = max(abs(a - b) / a for a, b in zip(x86, arm))
print(f"lite_arm64: {model} largest relative loss difference arm64 vs x86-64: {worst:.2e}")
if worst > 1e-4:
    print(f"lite_arm64: FAIL: {model}: the builds' losses differ by {worst:.2e} (> 1e-4)")
    ok = False

def values(path):  # the f32 values before the file's trailing u64 checksum (docs/lite.md)
    data = open(path, "rb").read()
    body = data[:-8]
    for n in range(1001, len(body) // 4):
        start = len(body) - 4 * n
        if struct.unpack_from("<Q", body, start - 8)[0] == n:
            return struct.unpack_from(f"<{n}f", body, start)
    raise SystemExit(f"lite_arm64: FAIL: no value block in {path}")

a, b = values(f"{model}.x86-64.lite"), values(f"{model}.arm64.lite")
diff = max(abs(p - q) for p, q in zip(a, b)) / max(abs(p) for p in a)
print(f"lite_arm64: {model} trained weights arm64 vs x86-64: largest difference / largest weight {diff:.2e}")
if len(a) != len(b) or diff > 1e-4:
    print(f"lite_arm64: FAIL: {model}: the trained weights differ by {diff:.2e} (> 1e-4)")
    ok = False
sys.exit(0 if ok else 1)
EOF
}
check mlp 256 4
check cnn 64 3
[[ $status -eq 0 ]] && echo "lite_arm64: PASS"
exit $status
