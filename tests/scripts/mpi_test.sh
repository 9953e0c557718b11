#!/usr/bin/env bash
# sparrow-sim over MPI ranks against the one-process simulator, with the real
# binaries and mpirun (docs/simulator.md, "Several machines: MPI ranks"):
#  - the same seed gives the same final model bytes without mpirun, with
#    -np 1, -np 2 and -np 2 with 2 workers per rank, for a codec with
#    per-client state (STC's residual) and for SCAFFOLD's control variates
#    with a compressed downlink;
#  - client states stay on their owner rank (client c on rank c mod 2): rank
#    0's client_state.db holds the even clients, rank 1's
#    client_state.rank1.db the odd ones, both at the checkpoint's round, and
#    rank 0 sends per round no more than the model and the clients' ids;
#  - a run of 2 rounds on 2 ranks resumed to 4 on 2 ranks equals the
#    uninterrupted run; resuming it in one process, a one-process run on 2
#    ranks, or with a rank's store missing or at another round is refused
#    (exit 2, a message naming the file or the rank count);
#  - SIGUSR1 to mpirun, or to rank 1 alone, stops the run gracefully (every
#    rank's store committed at the same round), and --resume continues it;
#  - what cannot run over ranks (secagg) and a bad config end every rank
#    with a clear message and exit 2, without hanging;
#  - the summary reports the bytes each rank sent per round.
# Usage: mpi_test.sh SPARROW_SIM MPIEXEC [all|default|stop]
#   default: everything but the stops (ctest sim_mpi_ranks); stop: the two
#   SIGUSR1 stops (ctest sim_mpi_stop, labelled slow); all: both.
set -euo pipefail
sim=$1
mpiexec=$2
mode=${3:-all}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# Loopback TCP only: works wherever the service's own tests do (containers
# may forbid the shared-memory transport's cross-process reads, or lack
# /dev/shm), and no probing of network interfaces.
export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
fail() {
  echo "FAIL: $*" >&2
  fails=$((fails + 1))
}
mpi() {
  local np=$1
  shift
  timeout 180 "$mpiexec" -np "$np" --oversubscribe "$sim" "$@"
}
weights() {  # the run's final model as .npy files
  "$sim" export "$1" --out "$1/export" >/dev/null 2>&1 || fail "export $1"
}
q() {  # DB SQL: the first column of each row; nothing (and a failure) for a missing file or table
  python3 -c 'import sqlite3, sys
try:
    rows = list(sqlite3.connect("file:" + sys.argv[1] + "?mode=ro", uri=True).execute(sys.argv[2]))
except sqlite3.Error as e:
    sys.exit(sys.argv[1] + ": " + str(e))
for r in rows: print(r[0])' "$1" "$2" || fail "cannot read $1"
}
ckpt_round() { q "$1" "SELECT CAST(value AS TEXT) FROM meta WHERE key = 'checkpoint.round'"; }
same_ckpt() {  # RUN_DIR: every rank's store at client_state.db's checkpoint round
  local r0 r1
  r0=$(ckpt_round "$1/client_state.db")
  r1=$(ckpt_round "$1/client_state.rank1.db")
  [[ -n $r0 && $r0 == "$r1" ]] || fail "$1: rank 1's store is at round '$r1', client_state.db at '$r0'"
}
same_model() {  # same bytes
  if diff -r "$1/export/weights" "$2/export/weights" >/dev/null; then
    echo "ok: $3"
  else
    fail "$3: final models differ ($1 vs $2)"
  fi
}

cat >"$work/stc.toml" <<'TOML'
dataset = "synthetic:alpha=1,beta=1"
clients = 24
clients_per_round = 7
rounds = 4
model = "logreg"
batch_size = 16
lr = 0.05
eval_every = 2
workers = 1
client_batch = 1
compression = "stc:ratio=0.1"
server_optimizer = "fedavgm:lr=1,momentum=0.7"
seed = 11
TOML
cat >"$work/scaffold.toml" <<'TOML'
dataset = "synthetic:alpha=1,beta=1"
clients = 16
clients_per_round = 5
rounds = 4
model = "logreg"
batch_size = 16
lr = 0.05
eval_every = 4
workers = 1
client_batch = 1
algorithm = "scaffold"
compression = "topk:ratio=0.3,ef=1"
downlink = "topk:ratio=0.5"
seed = 5
TOML

if [[ $mode != stop ]]; then
# One process, workers = 1: the reference.
"$sim" --config "$work/stc.toml" --set out="$work/stc_plain" >/dev/null 2>&1 || fail "stc plain run"
weights "$work/stc_plain"
mpi 1 --config "$work/stc.toml" --set out="$work/stc_np1" >/dev/null 2>"$work/np1.log" || fail "stc -np 1"
weights "$work/stc_np1"
same_model "$work/stc_plain" "$work/stc_np1" "stc: -np 1 = one process"
mpi 2 --config "$work/stc.toml" --set out="$work/stc_np2" >"$work/np2.json" 2>"$work/np2.log" ||
  { cat "$work/np2.log" >&2; fail "stc -np 2"; }
weights "$work/stc_np2"
same_model "$work/stc_plain" "$work/stc_np2" "stc: -np 2 = one process"
grep -q '"ranks":2,"rank_bytes_per_round":\[[0-9.e+]*,[0-9.e+]*\]' "$work/np2.json" ||
  fail "stc -np 2: no per-rank bytes in the summary: $(cat "$work/np2.json")"
grep -q "2 MPI ranks" "$work/np2.log" || fail "stc -np 2: the log does not say it runs on 2 ranks"
# Owner ranks: each store holds its own clients, the union is the one-process store's.
odd0=$(q "$work/stc_np2/client_state.db" "SELECT COUNT(*) FROM client_state WHERE client_id % 2 = 1")
even1=$(q "$work/stc_np2/client_state.rank1.db" "SELECT COUNT(*) FROM client_state WHERE client_id % 2 = 0")
[[ $odd0 == 0 && $even1 == 0 ]] || fail "stc -np 2: a store holds another rank's clients ($odd0 odd on rank 0, $even1 even on rank 1)"
cmp -s <(q "$work/stc_plain/client_state.db" "SELECT client_id FROM client_state ORDER BY client_id") \
  <({ q "$work/stc_np2/client_state.db" "SELECT client_id FROM client_state"
    q "$work/stc_np2/client_state.rank1.db" "SELECT client_id FROM client_state"; } | sort -n) ||
  fail "stc -np 2: the ranks' stores do not hold the one-process run's clients"
same_ckpt "$work/stc_np2"
[[ ! -e "$work/stc_plain/client_state.rank1.db" && ! -e "$work/stc_np1/client_state.rank1.db" ]] ||
  fail "one process / -np 1 wrote a rank store"
# Rank 0 sends the model (and client ids), never client states: STC's residual
# is model-sized, so 3-4 of them a round would double its bytes.
model_bytes=$(cat "$work/stc_plain/export/weights/"* | wc -c)
rank0=$(grep -o '"rank_bytes_per_round":\[[0-9.e+]*' "$work/np2.json" | grep -o '[0-9.e+]*$')
awk -v b="$rank0" -v m="$model_bytes" 'BEGIN { exit !(b <= m + 2048) }' ||
  fail "stc -np 2: rank 0 sent $rank0 bytes per round, more than the model ($model_bytes bytes) and the ids"
mpi 2 --config "$work/stc.toml" --set out="$work/stc_np2w2" --set workers=2 >/dev/null 2>&1 || fail "stc -np 2 workers=2"
weights "$work/stc_np2w2"
same_model "$work/stc_plain" "$work/stc_np2w2" "stc: -np 2 x 2 workers = one process"

"$sim" --config "$work/scaffold.toml" --set out="$work/sc_plain" >/dev/null 2>&1 || fail "scaffold plain run"
weights "$work/sc_plain"
mpi 2 --config "$work/scaffold.toml" --set out="$work/sc_np2" >/dev/null 2>&1 || fail "scaffold -np 2"
weights "$work/sc_np2"
same_model "$work/sc_plain" "$work/sc_np2" "scaffold + downlink: -np 2 = one process"

# Resume: 2 rounds on 2 ranks, then to 4 rounds on 2 ranks / in one process.
mpi 2 --config "$work/stc.toml" --set out="$work/stc_res" --set rounds=2 >/dev/null 2>&1 || fail "stc 2 rounds -np 2"
cp -r "$work/stc_res" "$work/stc_res1"
mpi 2 --resume "$work/stc_res" --set rounds=4 >/dev/null 2>&1 || fail "resume -np 2"
weights "$work/stc_res"
same_model "$work/stc_plain" "$work/stc_res" "stc: 2 rounds on 2 ranks resumed on 2 ranks = uninterrupted"
same_ckpt "$work/stc_res"
cmp -s <(cut -d, -f1-6 "$work/stc_plain/metrics.csv") <(cut -d, -f1-6 "$work/stc_res/metrics.csv") ||
  fail "resumed metrics.csv differs from the uninterrupted run's"
# What a resume refuses: another rank count, a rank's store missing or at
# another round than the checkpoint (exit 2, nothing run).
refused() {  # NAME PATTERN NP ARGS...: exit 2 and PATTERN in the log
  local name=$1 pattern=$2 np=$3 rc
  shift 3
  set +e
  if [[ $np == 0 ]]; then timeout 180 "$sim" "$@" >/dev/null 2>"$work/$name.log"; else mpi "$np" "$@" >/dev/null 2>"$work/$name.log"; fi
  rc=$?
  set -e
  [[ $rc == 2 ]] || fail "$name: exit $rc, expected 2: $(grep -v '^\[' "$work/$name.log" | tail -2)"
  grep -q -- "$pattern" "$work/$name.log" || fail "$name: no clear message ($pattern): $(tail -2 "$work/$name.log")"
}
refused "2 ranks resumed in one process" "mpirun -np 2" 0 --resume "$work/stc_res1" --set rounds=4
refused "one process resumed on 2 ranks" "without mpirun" 2 --resume "$work/stc_plain" --set rounds=6
cp -r "$work/stc_res" "$work/stc_behind"
rm -f "$work/stc_behind/client_state.rank1.db"*
cp "$work/stc_res1/client_state.rank1.db"* "$work/stc_behind/"
refused "a rank's store at another round" "client_state.rank1.db holds the client states of round 2" 2 \
  --resume "$work/stc_behind" --set rounds=6
rm -f "$work/stc_behind/client_state.rank1.db"*
refused "a rank's store missing" "client_state.rank1.db is missing" 2 --resume "$work/stc_behind" --set rounds=6

# Refusals end every rank: exit 2, a clear message, no hang (timeout 180 s).
set +e
mpi 2 --config "$work/stc.toml" --set out="$work/sa" --set compression=none \
  --set secagg=secagg+:degree=4,threshold=2 >/dev/null 2>"$work/sa.log"
rc=$?
set -e
[[ $rc == 2 ]] || fail "secagg over ranks: exit $rc, expected 2: $(tail -3 "$work/sa.log")"
grep -q "secagg: not available over MPI ranks" "$work/sa.log" || fail "secagg over ranks: no clear message"
set +e
mpi 2 --config "$work/stc.toml" --set out="$work/bad" --set no_such_key=1 >/dev/null 2>"$work/bad.log"
rc=$?
set -e
[[ $rc == 2 ]] || fail "unknown key over ranks: exit $rc, expected 2"
grep -q "no_such_key" "$work/bad.log" || fail "unknown key over ranks: the message does not name the key"
[[ ! -e "$work/bad/run.db" ]] || fail "unknown key over ranks: a run folder was written"

fi

if [[ $mode != default ]]; then
# A graceful stop: mpirun forwards SIGUSR1, each rank stops after the clients
# in training, rank 0 gives the round up, checkpoints, every rank exits (130);
# --resume on 2 ranks then ends where the uninterrupted run does. When only
# rank 1 gets SIGUSR1, its untrained clients make rank 0 do the same.
"$sim" --config "$work/stc.toml" --set out="$work/long_plain" --set rounds=200 --set eval_every=200 >/dev/null 2>&1 ||
  fail "200 rounds plain"
weights "$work/long_plain"
stop_and_resume() {  # NAME TARGET: TARGET is "mpirun" or "rank 1"
  local name=$1 target=$2 pid rc
  set +e
  "$mpiexec" -np 2 --oversubscribe "$sim" --config "$work/stc.toml" --set out="$work/$name" --set rounds=200 \
    --set eval_every=200 >/dev/null 2>"$work/$name.log" &
  pid=$!
  for _ in $(seq 600); do
    [[ -f "$work/$name/metrics.csv" && $(wc -l <"$work/$name/metrics.csv") -ge 4 ]] && break
    sleep 0.05
  done
  if [[ $target == mpirun ]]; then
    kill -USR1 $pid
  else
    for p in $(pgrep -f "out=$work/$name"); do
      if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then kill -USR1 "$p"; fi
    done
  fi
  wait $pid
  rc=$?
  set -e
  [[ $rc == 130 ]] ||
    fail "SIGUSR1 to $target: exit $rc, expected 130 (stopped and checkpointed): $(grep -v '^\[' "$work/$name.log" | tail -3)"
  grep -q "interrupted after round" "$work/$name.log" || fail "SIGUSR1 to $target: rank 0 did not say where it stopped"
  same_ckpt "$work/$name"
  mpi 2 --resume "$work/$name" >/dev/null 2>&1 || fail "resume after SIGUSR1 to $target"
  weights "$work/$name"
  same_model "$work/long_plain" "$work/$name" "stopped by SIGUSR1 to $target and resumed = uninterrupted"
  same_ckpt "$work/$name"
}
stop_and_resume long mpirun
stop_and_resume long1 "rank 1"

fi

if [[ $fails -gt 0 ]]; then
  echo "$fails check(s) failed" >&2
  exit 1
fi
echo "all MPI checks passed"
