#!/usr/bin/env bash
# Mixed federations on loopback: a real sparrow-server, two sparrow-client and
# two sparrow-client-lite (CurveZMQ, the MLP, 3 rounds), each against the same
# run with four sparrow-client: the final global models must agree within 1e-4
# of the largest weight (largest absolute difference / largest absolute
# weight). 1. DGC uplink, a lite client killed with SIGKILL after its first
# acknowledged update and restarted (it must resume from its state file);
# 2. SCAFFOLD, TCS (fp32 values) and a top-k downlink, a restart too;
# 3. SecAgg+. 4. PowerSGD uplink and a PowerSGD downlink (the lite clients'
# torch-free PowerSGD). 5. ACP-SGD uplink (the shared factors in Task.shared),
# a restart too. Also checks that sparrow-client-lite links no LibTorch.
#
#   lite_client_mixed_test.sh BUILD_DIR      (SPARROW_TEST_KEEP=1 keeps the run folders)
set -euo pipefail
test_name=lite_client_mixed
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
build=$(cd "$1" && pwd)
bin="$build/bin"
start_work
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

for b in sparrow-server sparrow-client sparrow-client-lite sparrow-lite-export; do
  [[ -x "$bin/$b" ]] || fail "$bin/$b is not built"
done
if ldd "$bin/sparrow-client-lite" | grep -Ei 'torch|libc10'; then
  fail "sparrow-client-lite links LibTorch"
fi

# Four data folders (x.npy float32 [256, 784], y.npy int64 [256]): ten
# Gaussian classes, one folder per client, the same for both runs.
gaussian_folders "$work/d1:256" "$work/d2:256" "$work/d3:256" "$work/d4:256"

"$bin/sparrow-server" keygen --out "$work/keys" --clients 4 > "$work/keygen.log" 2>&1 || fail "keygen failed"
# The lite clients' model: the MLP's architecture (its weights come from the server).
"$bin/sparrow-lite-export" --model mlp --seed 5 -o "$work/mlp.lite" > "$work/export.log" 2>&1 ||
  { cat "$work/export.log" >&2; fail "sparrow-lite-export failed"; }

start_client() {  # RUN I KIND(full|lite) -> pid in $started
  local run=$1 i=$2 kind=$3 log_suffix=${4:-}
  local toml="$run/c$i.toml"
  {
    echo "server = \"$endpoint\""
    echo "server_key = \"$work/keys/server.key\""
    echo "key = \"$work/keys/client$i.key_secret\""
    echo "client_id = \"c$i\""
    echo "model = \"mlp\""
    echo "data = \"folder:$work/d$i\""
    echo "backoff_initial_ms = 100"
    echo "backoff_max_ms = 1000"
    if [[ $kind == lite ]]; then
      echo "model_file = \"$work/mlp.lite\""
      echo "state_file = \"$run/c$i.lite\""
    else
      echo "state_db = \"$run/c$i.db\""
    fi
  } > "$toml"
  local prog=(sparrow-client "${full_flags[@]}")
  [[ $kind == lite ]] && prog=(sparrow-client-lite)
  "$bin/${prog[0]}" "${prog[@]:1}" --config "$toml" > "$run/c$i$log_suffix.log" 2>&1 &
  started=$!
  pids+=("$started")
}

# One run: KINDS of clients 1..4 ("full full lite lite"); KILL = the client to
# kill -9 after its first acknowledged update and restart (0: none); EXTRA:
# server keys on top of the shared ones; server_sets: --set flags.
server_sets=()
full_flags=()
run_federation() {  # NAME KILL EXTRA KINDS...
  local name=$1 kill=$2 extra=$3
  shift 3
  local kinds=("$@")
  local run="$work/$name"
  mkdir -p "$run"
  cat > "$run/server.toml" <<TOML
listen = "tcp://127.0.0.1:*"
key = "$work/keys/server.key_secret"
allow = "$work/keys/allow.txt"
db = "$run/server.db"
model = "mlp"
rounds = 3
clients_per_round = 4
min_clients = 4
round_deadline_s = 120
seed = 5
model_seed = 5
lr = 0.05
local_epochs = 1
batch_size = 32
$extra
TOML
  "$bin/sparrow-server" --config "$run/server.toml" "${server_sets[@]}" > "$run/server.log" 2>&1 &
  local server=$!
  pids+=("$server")
  # At most 5 minutes a run: a hung run fails with its logs (its clients are killed on exit).
  (
    for ((t = 0; t < 300; ++t)); do
      sleep 1
      kill -0 "$server" 2>/dev/null || exit 0
    done
    kill -9 "$server"
  ) > /dev/null 2>&1 &
  wait_log "$run/server.log" "event=listening" 60 "$server" ||
    { cat "$run/server.log" >&2; fail "$name: the server did not start"; }
  endpoint=$(log_endpoint "$run/server.log")
  local cpids=()
  # With a kill, the sparrow-client wait 500 ms before each update: a round
  # then lasts that long, and the kill (this script reads the log up to
  # ~0.1 s late) lands before the killed client could answer the last round;
  # without it the rounds take ~40 ms and the run could end while the client
  # is down, leaving it reconnecting for ever. Timing only: same updates.
  full_flags=()
  [[ $kill != 0 ]] && full_flags=(--update-delay-ms 500)
  for i in 1 2 3 4; do
    start_client "$run" "$i" "${kinds[$((i - 1))]}"
    cpids+=("$started")
  done
  if [[ $kill != 0 ]]; then
    wait_log "$run/c$kill.log" "round 1: update acknowledged" 240 ||
      { tail -n 20 "$run/c$kill.log" >&2; fail "$name: client $kill never had an update acknowledged"; }
    kill -9 "${cpids[$((kill - 1))]}"
    wait "${cpids[$((kill - 1))]}" 2>/dev/null || true
    echo "lite_client_mixed: $name: client c$kill killed (SIGKILL) after round 1, restarting"
    start_client "$run" "$kill" "${kinds[$((kill - 1))]}" .restarted
    cpids[$((kill - 1))]=$started
  fi
  local rc=0
  wait "$server" || rc=$?
  [[ $rc == 0 ]] || { tail -n 30 "$run/server.log" >&2; fail "$name: sparrow-server exited with $rc"; }
  for i in 1 2 3 4; do
    rc=0
    wait "${cpids[$((i - 1))]}" || rc=$?
    local log="$run/c$i.log"
    [[ $kill == "$i" ]] && log="$run/c$i.restarted.log"
    [[ $rc == 0 ]] || { tail -n 30 "$log" >&2; fail "$name: client c$i (${kinds[$((i - 1))]}) exited with $rc"; }
  done
  "$bin/sparrow-server" export --db "$run/server.db" --out "$run/export" > "$run/export.log" 2>&1 ||
    { cat "$run/export.log" >&2; fail "$name: export failed"; }
}

# The final global models of runs A and B: largest |difference| over largest |weight| <= 1e-4.
compare() {  # A B
  python3 - "$work/$1/export/weights" "$work/$2/export/weights" "$1 vs $2" <<'PY' || fail "the final models of runs $1 and $2 differ by more than 1e-4"
import array, os, struct, sys
def load(path):
    b = open(path, "rb").read()
    assert b[:6] == b"\x93NUMPY", path
    hl = struct.unpack("<H", b[8:10])[0] if b[6] == 1 else struct.unpack("<I", b[8:12])[0]
    start = 10 if b[6] == 1 else 12
    header = b[start:start + hl].decode()
    assert "'<f4'" in header, header
    a = array.array("f")
    a.frombytes(b[start + hl:])
    return a
a_dir, b_dir = sys.argv[1], sys.argv[2]
names = sorted(f for f in os.listdir(a_dir) if f.endswith(".npy"))
assert names and names == sorted(f for f in os.listdir(b_dir) if f.endswith(".npy")), "different parameters"
diff = big = 0.0
for n in names:
    a, b = load(os.path.join(a_dir, n)), load(os.path.join(b_dir, n))
    assert len(a) == len(b), n
    diff = max(diff, max(abs(p - q) for p, q in zip(a, b)))
    big = max(big, max(abs(p) for p in a))
ratio = diff / big
print("lite_client_mixed: %s: largest |difference| %.3g, largest |weight| %.3g, ratio %.3g (limit 1e-4)" % (sys.argv[3], diff, big, ratio))
sys.exit(0 if ratio <= 1e-4 else 1)
PY
}

# 1. DGC uplink; lite client c4 killed after round 1 and restarted.
run_federation torch 0 'compression = "dgc:ratio=0.01"' full full full full
run_federation mixed 4 'compression = "dgc:ratio=0.01"' full full lite lite
compare torch mixed
mixed="$work/mixed"
# The restarted lite client resumed: it read its state file and held a model.
grep -q "state: holding the broadcast model of round" "$mixed/c4.restarted.log" ||
  { cat "$mixed/c4.restarted.log" >&2; fail "the restarted lite client did not resume from its state file"; }
grep -q "last_round none" "$mixed/c4.restarted.log" &&
  { cat "$mixed/c4.restarted.log" >&2; fail "the restarted lite client said it held no model"; }
grep -q "update acknowledged" "$mixed/c4.restarted.log" || fail "the restarted lite client c4 sent no update"
grep -q "round 3: update acknowledged" "$mixed/c3.log" || fail "lite client c3 did not take part in round 3"

# 2. SCAFFOLD (c_i in the state file), TCS with fp32 values (the server's masks
# in Task.shared) and a top-k downlink (Tasks carrying a model delta against
# an older round); lite client c3 killed after round 1 and restarted.
both='algorithm = "scaffold"
compression = "tcs:ratio=0.1,values=fp32"
downlink = "topk:ratio=0.1"'
run_federation torch2 0 "$both" full full full full
run_federation mixed2 3 "$both" full full lite lite
compare torch2 mixed2
grep -q "state: holding the broadcast model of round" "$work/mixed2/c3.restarted.log" ||
  { cat "$work/mixed2/c3.restarted.log" >&2; fail "mixed2: the restarted lite client did not resume"; }

# 3. SecAgg+ (the lite clients quantise into the ring themselves).
sa='compression = "none"
secagg = "secagg+:degree=4,threshold=2,clip=4,timeout=10"'
run_federation torch3 0 "$sa" full full full full
run_federation mixed3 0 "$sa" full full lite lite
compare torch3 mixed3
grep -q "round 3: secure aggregation: shares revealed" "$work/mixed3/c3.log" ||
  { cat "$work/mixed3/c3.log" >&2; fail "mixed3: lite client c3 did not finish SecAgg+ round 3"; }

# 4. PowerSGD both ways: the lite clients encode with the torch-free PowerSGD
# (warm-start Q and residual in their state file: c4 is killed after round 1
# and restarted) and decode the low-rank downlink without LibTorch. fp32
# factors: with values=fp16 the trainers' last-bit differences can round a
# factor to the next fp16 value and the runs drift apart (1.4e-5 here; 7e-4
# with a powersgd downlink too), as for the quantising codecs in docs/lite.md.
psgd='compression = "powersgd:rank=2"
downlink = "powersgd:rank=4"'
run_federation torch4 0 "$psgd" full full full full
run_federation mixed4 4 "$psgd" full full lite lite
compare torch4 mixed4
for log in c3.log c4.restarted.log; do
  grep -q "round 3: update acknowledged" "$work/mixed4/$log" ||
    { cat "$work/mixed4/$log" >&2; fail "mixed4: lite client $log did not take part in round 3 with powersgd"; }
done

# 5. ACP-SGD: the lite clients encode one factor a round against the server's
# shared factor from Task.shared (P rounds and Q rounds alternate: rounds 1
# and 3 send Q, round 2 P), their residual in the state file: c4 is killed
# after round 1 and restarted.
run_federation torch5 0 'compression = "acp:rank=2"' full full full full
run_federation mixed5 4 'compression = "acp:rank=2"' full full lite lite
compare torch5 mixed5
grep -q "state: holding the broadcast model of round" "$work/mixed5/c4.restarted.log" ||
  { cat "$work/mixed5/c4.restarted.log" >&2; fail "mixed5: the restarted lite client did not resume"; }
for log in c3.log c4.restarted.log; do
  grep -q "round 3: update acknowledged" "$work/mixed5/$log" ||
    { cat "$work/mixed5/$log" >&2; fail "mixed5: lite client $log did not take part in round 3 with acp"; }
done
grep -q "task refused" "$work/mixed5/c3.log" "$work/mixed5/c4.log" "$work/mixed5/c4.restarted.log" &&
  fail "mixed5: a lite client refused an acp task"
echo "lite_client_mixed: passed"
