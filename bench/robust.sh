#!/usr/bin/env bash
# Robust aggregation under attack, and DP accuracy against epsilon, from real
# sparrow-sim runs on examples/results/robust_base.toml (Fashion-MNIST,
# Dirichlet(0.5), 100 clients, 20 per round, MLP). One JSON line per run:
#   {"case":"robust","aggregator":..,"attack":..,"adversaries":..,"dp":..,"seed":..,
#    "accuracy":..,"epsilon":..,"bytes_up":..,"real_s":..}
# accuracy: the last evaluation (round `rounds`); epsilon: at delta = 1e-5.
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
run() {
  local agg=$2 attack=$3 adv=$4 dp=$5 seed=$6
  local summary
  summary=$("$SIM" --config "$BASE" --set out="$out/$1" --set rounds="$rounds" --set seed="$seed" \
    --set aggregator="$agg" --set attack="$attack" --set adversaries="$adv" --set dp="$dp" \
    "${extra[@]}" 2>/dev/null | tail -n 1)
  python3 - "$summary" "$agg" "$attack" "$adv" "$dp" "$seed" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
print(json.dumps({"case": "robust", "aggregator": sys.argv[2], "attack": sys.argv[3],
                  "adversaries": float(sys.argv[4]), "dp": sys.argv[5], "seed": int(sys.argv[6]),
                  "accuracy": s["accuracy"], "epsilon": s.get("epsilon"), "bytes_up": s["bytes_up"],
                  "real_s": s["real_s"]}), flush=True)
PY
}

IFS=, read -r -a seed_list <<< "$seeds"
AGGS=(mean median "trimmed_mean:beta=0.2" "krum:f=4" "multikrum:f=4" "bulyan:f=4" "normclip:q=0.5")
for seed in "${seed_list[@]}"; do
  if [[ ",$cases," == *",robust,"* ]]; then
    for agg in "${AGGS[@]}"; do
      run "clean_${seed}_$agg" "$agg" sign_flip 0 none "$seed"
      run "flip_${seed}_$agg" "$agg" "sign_flip:scale=10" 0.2 none "$seed"
    done
    for agg in mean "trimmed_mean:beta=0.2" "multikrum:f=4" "bulyan:f=4"; do
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
