#!/usr/bin/env bash
# Robust aggregation under attack, and DP accuracy against epsilon, from real
# sparrow-sim runs on examples/results/robust_base.toml (Fashion-MNIST,
# Dirichlet(0.5), 100 clients, 20 per round, MLP). One JSON line per run:
#   {"case":"robust","aggregator":..,"attack":..,"adversaries":..,"dp":..,"seed":..,
#    "rounds":..,"accuracy":..,"epsilon":..,"bytes_up":..,"real_s":..,"diverged":..}
# accuracy: the last evaluation (round `rounds` unless the run diverged);
# epsilon: after the last round, at delta = 1e-5.
#   bench/robust.sh [--cases robust,dp] [--seeds 1,2] [--rounds 30] [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=${SPARROW_SIM:-build/bin/sparrow-sim}
BASE=examples/results/robust_base.toml
cases=robust,dp
seeds=1
rounds=30
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cases) cases=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    *) echo "usage: bench/robust.sh [--cases robust,dp] [--seeds 1,2] [--rounds N] [--set k=v]" >&2; exit 2 ;;
  esac
done
[[ -x "$SIM" ]] || { echo "robust.sh: $SIM not built (scripts/build.sh)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# run NAME AGGREGATOR ATTACK ADVERSARIES DP SEED
# A run whose clients diverge (an attacked plain mean) stops with an error:
# its line then says "diverged": true with the last evaluation before it.
run() {
  local agg=$2 attack=$3 adv=$4 dp=$5 seed=$6
  local err=0
  "$SIM" --config "$BASE" --force --set out="$out/$1" --set rounds="$rounds" --set seed="$seed" \
    --set aggregator="$agg" --set attack="$attack" --set adversaries="$adv" --set dp="$dp" \
    "${extra[@]}" > "$out/$1.out" 2> "$out/$1.err" || err=$?
  python3 - "$out/$1" "$agg" "$attack" "$adv" "$dp" "$seed" "$err" <<'PY'
import csv, json, sys
run, agg, attack, adv, dp, seed, err = sys.argv[1:]
rows = list(csv.DictReader(open(run + "/metrics.csv")))
evals = [r for r in rows if r["accuracy"]]
last = lambda k: next((float(r[k]) for r in reversed(rows) if r.get(k)), None)
line = {"case": "robust", "aggregator": agg, "attack": attack, "adversaries": float(adv), "dp": dp,
        "seed": int(seed), "rounds": len(rows), "accuracy": float(evals[-1]["accuracy"]) if evals else None,
        "epsilon": last("epsilon"), "bytes_up": sum(int(r["bytes_up"]) for r in rows),
        "real_s": round(sum(float(r["real_s"]) for r in rows), 3), "diverged": err != "0"}
if err != "0":
    line["error"] = open(run + ".err").read().strip().splitlines()[-1][:200]
print(json.dumps(line), flush=True)
PY
}

IFS=, read -r -a seed_list <<< "$seeds"
# f and beta cover the adversaries a round can hold: with 20 of 100 clients
# adversarial and 20 selected, more than 7 in a round has probability 0.018
# (hypergeometric); Bulyan allows at most f = (20 - 3) / 4 = 4.
AGGS=(mean median "trimmed_mean:beta=0.35" "krum:f=7" "multikrum:f=7" "bulyan:f=4" "normclip:q=0.5")
for seed in "${seed_list[@]}"; do
  if [[ ",$cases," == *",robust,"* ]]; then
    for agg in "${AGGS[@]}"; do
      run "clean_${seed}_$agg" "$agg" sign_flip 0 none "$seed"
      run "flip_${seed}_$agg" "$agg" "sign_flip:scale=10" 0.2 none "$seed"
    done
    for agg in mean "trimmed_mean:beta=0.35" "multikrum:f=7" "bulyan:f=4"; do
      run "alie_${seed}_$agg" "$agg" alie 0.2 none "$seed"
    done
  fi
  if [[ ",$cases," == *",dp,"* ]]; then
    for noise in 0.3 1 3; do
      run "dp_${seed}_$noise" mean sign_flip 0 "central:clip=0.5,noise=$noise" "$seed"
      run "dpa_${seed}_$noise" mean sign_flip 0 "central:clip=0.5,noise=$noise,adaptive=1,count_noise=2" "$seed"
    done
    run "ldp_${seed}" mean sign_flip 0 "local:clip=0.5,noise=1" "$seed"
  fi
done
