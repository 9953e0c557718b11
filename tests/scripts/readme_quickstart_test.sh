#!/usr/bin/env bash
# Runs README.md's quick start exactly as printed: every ```sh block that follows
# a `<!-- quickstart -->` line, in order, each with `bash -e`, in a fresh folder
# that looks like the repository's root (a copy of scripts/, links to examples/
# and to the build). SPARROW_QUICK=1 is the one allowance: scripts/demo.sh then
# runs 2 rounds and uses the binaries already built. A block marked
# `<!-- quickstart needs=python3-torch -->` runs only where python3 imports torch
# and numpy (Debian's /usr/bin/python3 is preferred over another python3 on
# PATH); otherwise it is skipped with a note (the steps do not depend on each
# other).
#
#   readme_quickstart_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/sparrow-readme.XXXXXX")
trap 'rm -rf "$work"' EXIT

fail() {
  echo "readme_quickstart: $*" >&2
  exit 1
}

# The blocks, one file each; blocks/N.needs holds the marker's requirement.
mkdir -p "$work/blocks"
awk -v dir="$work/blocks" '
  /^<!-- quickstart( needs=[a-z0-9-]+)? -->$/ {
    marked = 1; needs = ""
    if (match($0, /needs=[a-z0-9-]+/)) needs = substr($0, RSTART + 6, RLENGTH - 6)
    next
  }
  marked && /^```sh$/ { n++; file = dir "/" n ".sh"; printf "%s", needs > (dir "/" n ".needs"); inside = 1; marked = 0; next }
  inside && /^```$/ { inside = 0; close(file); next }
  inside { print > file; next }
  marked && !/^[ \t]*$/ { printf "a quickstart marker is not followed by a ```sh block: %s\n", $0 > "/dev/stderr"; exit 1 }
' "$src/README.md" || fail "README.md's quickstart markers are malformed"
blocks=$(find "$work/blocks" -name '*.sh' | wc -l)
# The quick start is three steps; fewer blocks means markers were lost.
[[ $blocks -ge 3 ]] || fail "found $blocks quickstart blocks in README.md, expected at least 3"
grep -qx 'scripts/demo.sh' "$work/blocks/1.sh" || fail "the first quickstart block does not run scripts/demo.sh"
grep -q 'sparrow-server try' "$work"/blocks/*.sh || fail "no quickstart block runs sparrow-server try"

root="$work/root"
mkdir -p "$root" "$work/bin"
cp -r "$src/scripts" "$root/scripts"
ln -s "$src/examples" "$root/examples"
ln -s "$build" "$root/build"
[[ -x "$build/bin/sparrow-sim" ]] || fail "$build/bin/sparrow-sim is not built"

have_torch=0
if /usr/bin/python3 -c 'import torch, numpy' 2>/dev/null; then
  ln -s /usr/bin/python3 "$work/bin/python3"
  have_torch=1
elif python3 -c 'import torch, numpy' 2>/dev/null; then
  have_torch=1
fi

for ((i = 1; i <= blocks; ++i)); do
  needs=$(cat "$work/blocks/$i.needs")
  case "$needs" in "" | python3-torch) ;; *) fail "block $i: unknown requirement '$needs'" ;; esac
  if [[ "$needs" == python3-torch && $have_torch == 0 ]]; then
    echo "readme_quickstart: SKIPPED block $i (it needs python3 with torch and numpy)"
    continue
  fi
  echo "readme_quickstart: block $i:"
  sed 's/^/    /' "$work/blocks/$i.sh"
  start=$(date +%s)
  rc=0
  (cd "$root" && env -u SPARROW_BUILD_DIR PATH="$work/bin:$PATH" SPARROW_QUICK=1 bash -e "$work/blocks/$i.sh") \
    > "$work/out_$i.txt" 2>&1 || rc=$?
  if [[ $rc != 0 ]]; then
    tail -n 40 "$work/out_$i.txt" >&2
    fail "block $i exited with status $rc"
  fi
  echo "readme_quickstart: block $i passed in $(($(date +%s) - start)) s"
done

# What the README says the steps leave behind.
[[ -f "$root/runs/dgc_mnist/metrics.csv" && -f "$root/runs/dgc_mnist/dashboard.html" ]] ||
  fail "the demo left no runs/dgc_mnist/metrics.csv and dashboard.html"
tail -n 1 "$root/runs/dgc_mnist/metrics.csv" | grep -q '^2,' || fail "the demo did not run 2 rounds under SPARROW_QUICK=1"
if [[ $have_torch == 1 ]]; then
  for f in model.pt state_dict.pt weights/fc1.weight.npy; do
    [[ -f "$root/runs/mine/export/$f" ]] || fail "step 2 left no runs/mine/export/$f"
  done
  cat "$work"/out_*.txt | grep -q "^test accuracy 0\\.9" || fail "step 2's weights, loaded into Net, do not reach 90%"
fi
[[ -f "$root/sparrow-try/server.db" ]] || fail "step 3 left no sparrow-try/server.db"
cat "$work"/out_*.txt | grep -q "completed rounds: 5" || fail "step 3's status does not show 5 completed rounds"
echo "readme_quickstart: passed"
