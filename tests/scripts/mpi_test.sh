#!/usr/bin/env bash
# sparrow-sim over MPI ranks against the one-process simulator, with the real
# binaries and mpirun (docs/simulator.md, "Several machines: MPI ranks"):
#  - the same seed gives the same final model bytes without mpirun, with
#    -np 1, -np 2 and -np 2 with 2 workers per rank, for a codec with
#    per-client state (STC's residual) and for SCAFFOLD's control variates
#    with a compressed downlink;
#  - a run of 2 rounds on 2 ranks resumed to 4 on 2 ranks, and one resumed on
#    one process, equal the uninterrupted run;
#  - SIGUSR1 to mpirun, or to rank 1 alone, stops the run gracefully, and
#    --resume continues it;
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
"$sim" --resume "$work/stc_res1" --set rounds=4 >/dev/null 2>&1 || fail "resume in one process"
weights "$work/stc_res1"
same_model "$work/stc_plain" "$work/stc_res1" "stc: 2 rounds on 2 ranks resumed in one process = uninterrupted"
cmp -s <(cut -d, -f1-6 "$work/stc_plain/metrics.csv") <(cut -d, -f1-6 "$work/stc_res/metrics.csv") ||
  fail "resumed metrics.csv differs from the uninterrupted run's"

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
  mpi 2 --resume "$work/$name" >/dev/null 2>&1 || fail "resume after SIGUSR1 to $target"
  weights "$work/$name"
  same_model "$work/long_plain" "$work/$name" "stopped by SIGUSR1 to $target and resumed = uninterrupted"
}
stop_and_resume long mpirun
stop_and_resume long1 "rank 1"

fi

if [[ $fails -gt 0 ]]; then
  echo "$fails check(s) failed" >&2
  exit 1
fi
echo "all MPI checks passed"
