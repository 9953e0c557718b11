#!/bin/bash
# Interleaved before/after of the round engine's benchmarks (docs/performance.md):
#   scripts/bench-compare.sh BASE_BUILD_DIR NEW_BUILD_DIR OUT.jsonl [PAIRS]
# runs `sparrow-bench server --cases ingest,dense` and `sparrow-bench sim --cases
# peer --models mlp` from each build, base then new, PAIRS times (default 2), and
# writes their JSON lines tagged with "side" and "rep". Build the baseline in a
# worktree: git worktree add /tmp/base COMMIT; cmake -S /tmp/base -B /tmp/base/build
# -DCMAKE_BUILD_TYPE=Release -DSPARROW_BUILD_TESTS=OFF; cmake --build ... --target sparrow-bench.
set -euo pipefail
base=$1 new=$2 out=$3 pairs=${4:-2}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
unset OPENBLAS_CORETYPE
py=${PYTHON:-/usr/bin/python3}  # the python3 with torch (python3-torch), not a pyenv one
: >"$out"
for rep in $(seq "$pairs"); do
  for side in base new; do
    if [ "$side" = base ]; then b=$base/bin/sparrow-bench; else b=$new/bin/sparrow-bench; fi
    tag="{\"side\":\"$side\",\"rep\":$rep,"
    "$b" server --cases ingest,dense 2>/dev/null | grep '^{' | sed "s/^{/$tag/" >>"$out"
    "$b" sim --cases peer --models mlp --python "$py" --tmp "/tmp/sparrow-bench-$side" 2>/dev/null |
      grep '^{' | sed "s/^{/$tag/" >>"$out"
  done
done
