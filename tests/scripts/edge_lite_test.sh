#!/usr/bin/env bash
# sparrow-edge-lite as a process against a real `sparrow-edge serve` on
# loopback (docs/split.md, "A device without LibTorch"):
# 1. for codec none and lowrank: one run with the LibTorch device
#    (sparrow-edge) and one with sparrow-edge-lite, each against a fresh
#    cloud, the same device config file (the lite device gets the model's
#    initial weights from `sparrow-lite-export --model mlp --seed 7`, the
#    LibTorch device draws them from seed 7): both exit 0 with the summary
#    line, the mean training loss each logs at its last step agrees within
#    1e-4 relative and the accuracy within one test sample;
# 2. a lite device killed with SIGKILL mid-run and restarted with the same
#    command resumes from its progress file and step log: it loses no step
#    (skipped 0) and its final progress file (weights, momentum, codec
#    state) is byte for byte that of an uninterrupted lite run;
# 3. sparrow-edge-lite links no LibTorch.
#
#   edge_lite_test.sh BUILD_DIR      (SPARROW_TEST_KEEP=1 keeps the run folder)
set -euo pipefail
test_name=edge_lite
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
build=$(cd "$1" && pwd)
bin="$build/bin"
start_work
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

for b in sparrow-edge sparrow-edge-lite sparrow-lite-export; do
  [[ -x "$bin/$b" ]] || fail "$bin/$b is not built"
done
if ldd "$bin/sparrow-edge-lite" | grep -Ei 'torch|libc10'; then
  fail "sparrow-edge-lite links LibTorch"
fi

# The device's data folder: x.npy float32 [512, 784], y.npy int64, and a
# test split test/x.npy + test/y.npy of 64 samples (ten Gaussian classes).
gaussian_folders "$work/data:512" "$work/data/test:64"
"$bin/sparrow-lite-export" --model mlp --seed 7 -o "$work/init.lite" > "$work/export.log" 2>&1 ||
  { cat "$work/export.log" >&2; fail "sparrow-lite-export failed"; }

start_cloud() {  # NAME [--set k=v]...: a fresh cloud (in memory) in $work/NAME -> $cloud_pid, $cloud_endpoint
  start_split_cloud "$work/$1" "${@:2}"
}
stop_cloud() {
  kill "$cloud_pid" 2>/dev/null || true
  wait "$cloud_pid" 2>/dev/null || true
}

write_device() {  # DIR ENDPOINT CODEC STEPS: the device config both devices take
  cat > "$1/device.toml" <<TOML
cloud = "$2"
device_id = "dev1"
model = "mlp"
cut = "fc1"
seed = 7
codec = "$3"
lr = 0.05
momentum = 0.9
batch_size = 16
steps = $4
data = "folder:$work/data"
eval_samples = 64
progress = "$1/progress.bin"
save_every = 7
reply_timeout_ms = 5000
backoff_initial_ms = 10
backoff_max_ms = 100
threads = 1
TOML
}

# The mean training loss a device logs at its last step.
last_loss() { grep -o 'event=step step=[0-9]* loss=[0-9.]*' "$1" | tail -1 | sed 's/.*loss=//'; }
field() { python3 -c 'import json,sys; v=json.loads(sys.argv[1])[sys.argv[2]]; print("null" if v is None else v)' "$1" "$2"; }

# ---- 1. the lite device against the LibTorch device ----
for codec in none "lowrank:rank=4"; do
  tag=${codec%%:*}
  for kind in torch lite; do
    start_cloud "$tag-$kind"
    dir="$work/$tag-$kind"
    write_device "$dir" "$cloud_endpoint" "$codec" 40
    if [[ $kind == torch ]]; then
      "$bin/sparrow-edge" --config "$dir/device.toml" --insecure > "$dir/summary.json" 2> "$dir/device.log" ||
        { cat "$dir/device.log" >&2; fail "$tag: sparrow-edge failed"; }
    else
      "$bin/sparrow-edge-lite" --config "$dir/device.toml" --insecure --set weights="$work/init.lite" \
        > "$dir/summary.json" 2> "$dir/device.log" || { cat "$dir/device.log" >&2; fail "$tag: sparrow-edge-lite failed"; }
    fi
    stop_cloud
  done
  t="$work/$tag-torch" l="$work/$tag-lite"
  ts=$(cat "$t/summary.json") ls=$(cat "$l/summary.json")
  [[ $(field "$ts" steps) == 40 && $(field "$ls" steps) == 40 ]] || fail "$tag: steps: torch $ts, lite $ls"
  tl=$(last_loss "$t/device.log") ll=$(last_loss "$l/device.log")
  ta=$(field "$ts" accuracy) la=$(field "$ls" accuracy)
  echo "edge_lite: $codec: mean loss torch $tl lite $ll; accuracy torch $ta lite $la"
  python3 - "$tl" "$ll" "$ta" "$la" <<'PY' || fail "$tag: the lite device's run differs from the LibTorch device's"
import sys
tl, ll, ta, la = map(float, sys.argv[1:])
assert abs(tl - ll) <= 1e-4 * abs(tl) + 1e-4, (tl, ll)  # the logged loss has 4 decimals
assert abs(ta - la) <= 1 / 64 + 1e-9, (ta, la)
PY
done

# ---- 2. kill -9 and restart ----
# A long run (3000 steps, a few seconds) at a learning rate that stays stable that long.
slow=(--set lr=0.01 --set momentum=0.5)
start_cloud "restart-ref" "${slow[@]}"
ref="$work/restart-ref"
write_device "$ref" "$cloud_endpoint" "lowrank:rank=4" 3000
"$bin/sparrow-edge-lite" --config "$ref/device.toml" --insecure --set weights="$work/init.lite" "${slow[@]}" \
  > "$ref/summary.json" 2> "$ref/device.log" || { cat "$ref/device.log" >&2; fail "restart: the reference run failed"; }
stop_cloud

start_cloud "restart" "${slow[@]}"
run="$work/restart"
write_device "$run" "$cloud_endpoint" "lowrank:rank=4" 3000
cmd=("$bin/sparrow-edge-lite" --config "$run/device.toml" --insecure --set weights="$work/init.lite" "${slow[@]}")
"${cmd[@]}" > "$run/summary1.json" 2> "$run/device1.log" &
dev=$!
pids+=("$dev")
# Killed between two progress saves: the steps after the last save live in the step log.
wait_log "$run/device1.log" "event=step step=100 " 120 || { cat "$run/device1.log" >&2; fail "restart: no step 100"; }
while [[ ! -s "$run/progress.bin.log" ]]; do sleep 0.01; done
kill -9 "$dev"
wait "$dev" 2>/dev/null && fail "restart: the device finished before it was killed"
"${cmd[@]}" > "$run/summary2.json" 2> "$run/device2.log" || { cat "$run/device2.log" >&2; fail "restart: the resumed run failed"; }
stop_cloud
grep -q "event=resumed" "$run/device2.log" || fail "restart: the device did not resume from its progress file"
s2=$(cat "$run/summary2.json")
echo "edge_lite: restarted: $(grep -o 'event=log_replayed [^ ]* [^ ]*' "$run/device2.log" || echo 'no step log'); $s2"
[[ $(field "$s2" steps) == 3000 && $(field "$s2" skipped) == 0 ]] || fail "restart: $s2"
cmp -s "$ref/progress.bin" "$run/progress.bin" ||
  fail "restart: the resumed device's final progress differs from an uninterrupted run's"
[[ $(field "$s2" accuracy) == $(field "$(cat "$ref/summary.json")" accuracy) ]] || fail "restart: accuracy differs"
echo "edge_lite: OK"
