#!/usr/bin/env bash
# Fuzzes the decoders that read bytes from a peer or from files an operator
# writes (fuzz/): builds the libFuzzer targets with clang, ASan and UBSan in
# build-fuzz/ (the first build takes about 15 minutes on 2 cores), then runs
# each for --seconds (default 300) on a corpus kept in build-fuzz/corpus/,
# seeded from tests/wire/golden. A crash, a sanitizer report, an exception
# other than sparrow::Error or a hang stops it with the input saved as
# build-fuzz/crash-* (reproduce: build-fuzz/bin/fuzz_<target> <file>).
#
#   scripts/fuzz.sh [--seconds N] [--targets wire,allow_list,key_file,act,config,secagg]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=300
targets=wire,allow_list,key_file,act,config,secagg
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --targets) targets="$2"; shift 2 ;;
    *) echo "usage: scripts/fuzz.sh [--seconds N] [--targets wire,allow_list,key_file,act,config,secagg]" >&2; exit 2 ;;
  esac
done
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ is needed (apt-get install clang)" >&2
  exit 2
fi
IFS=, read -r -a list <<<"$targets"
build=build-fuzz
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPARROW_FUZZ=ON \
  -DSPARROW_BUILD_TESTS=OFF -DSPARROW_BUILD_BENCH=OFF -DSPARROW_CUDA=OFF -DSPARROW_LIBXSMM=OFF >/dev/null
cmake --build "$build" --target "${list[@]/#/fuzz_}"
# LibTorch keeps allocations alive at exit: leaks are not what this looks for.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
for t in "${list[@]}"; do
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  if [[ "$t" == wire ]]; then cp -n tests/wire/golden/*.bin "$corpus"/ 2>/dev/null || true; fi
  if [[ "$t" == key_file ]]; then cp -n fuzz/seeds/key/* "$corpus"/ 2>/dev/null || true; fi
  seed_env=()
  if [[ "$t" == act || "$t" == secagg ]]; then seed_env=(env SPARROW_FUZZ_SEED_DIR="$corpus"); fi
  if [[ "$t" == config && -z "$(ls -A "$corpus")" ]]; then  # the examples, each for every parser
    i=0
    for f in examples/*.toml examples/*/*.toml; do
      for p in 0 1 2 3 4; do
        { printf "\\x0$p"; cat "$f"; } >"$corpus/p${p}_$i.toml"
      done
      i=$((i + 1))
    done
  fi
  echo "fuzz.sh: fuzz_$t for ${seconds}s (corpus $corpus)"
  if ! "${seed_env[@]}" "$build/bin/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
      -artifact_prefix="$build/" -print_final_stats=1 "$corpus" 2>"$build/fuzz_$t.log"; then
    echo "fuzz.sh: fuzz_$t found a problem; see $build/fuzz_$t.log and $build/crash-*" >&2
    tail -40 "$build/fuzz_$t.log" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$build/fuzz_$t.log" | sed "s/^/fuzz_$t: /"
  fi
done
exit $status
