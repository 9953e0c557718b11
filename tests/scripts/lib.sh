# What the process tests under tests/scripts/ share. Sourced, not run:
#   test_name=edge_lite   # the prefix of the script's messages
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# after `set -euo pipefail`. Defines functions only (and the array `pids`);
# nothing runs on sourcing.

pids=()  # processes start_work's exit trap kills (-9), for a script that fails midway

# fail MESSAGE: "$test_name: FAIL: MESSAGE" on stderr, exit 1.
fail() {
  echo "$test_name: FAIL: $*" >&2
  exit 1
}

# start_work: $work, a fresh folder under $TMPDIR (or /tmp); on exit every pid
# in `pids` is killed and the folder removed (SPARROW_TEST_KEEP=1 keeps it).
start_work() {
  work=$(mktemp -d "${TMPDIR:-/tmp}/sparrow-$test_name.XXXXXX")
  trap _lib_cleanup EXIT
}
_lib_cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [[ -n "${SPARROW_TEST_KEEP:-}" ]]; then echo "$test_name: kept $work"; else rm -rf "$work"; fi
}

# wait_log FILE PATTERN SECONDS [PID]: returns 0 once a line of FILE matches
# PATTERN (grep's basic regular expression), 1 after SECONDS, or at once when
# process PID (if given) has exited without writing it.
wait_log() {
  local end=$((SECONDS + $3))
  while ! grep -q -- "$2" "$1" 2>/dev/null; do
    ((SECONDS < end)) || return 1
    if [[ -n "${4:-}" ]] && ! kill -0 "$4" 2>/dev/null; then
      grep -q -- "$2" "$1" 2>/dev/null
      return
    fi
    sleep 0.1
  done
}

# log_endpoint FILE: the first `endpoint=tcp://HOST:PORT` FILE logs (a server's
# or cloud's `event=listening`), as tcp://HOST:PORT; nothing when there is none.
log_endpoint() {
  grep -o 'endpoint=tcp://[0-9.]*:[0-9]*' "$1" 2>/dev/null | head -n 1 | cut -d= -f2 || true
}

# npy_python [ARG]...: runs the Python program on stdin (sys.argv[1:] = ARGs)
# with npy(path, descr, shape, payload) defined: writes `payload` (bytes) as a
# .npy file (format 1.0, C order, header padded to 64 bytes) of dtype `descr`
# ("<f4", "<i8", "|u1", ...) and `shape` (a tuple).
npy_python() {
  local prog
  prog=$(cat)
  python3 -c "$_lib_npy_py
$prog" "$@"
}
_lib_npy_py='import struct
def npy(path, descr, shape, payload):
    dims = ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "")
    header = "{'"'"'descr'"'"': '"'"'%s'"'"', '"'"'fortran_order'"'"': False, '"'"'shape'"'"': (%s), }" % (descr, dims)
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + payload)'

# gaussian_folders DIR:N...: in each DIR (created) x.npy, float32 [N, 784], and
# y.npy, int64 [N]: ten Gaussian classes (means N(0, 1), noise N(0, 1.5)), the
# labels and samples of all folders drawn in order from one seed (7), so
# a script gets the same data on every run.
gaussian_folders() {
  npy_python "$@" <<'PY'
import array, os, random, sys
rng = random.Random(7)
means = [[rng.gauss(0, 1) for _ in range(784)] for _ in range(10)]
for arg in sys.argv[1:]:
    d, n = arg.rsplit(":", 1)
    n = int(n)
    os.makedirs(d)
    y = [rng.randrange(10) for _ in range(n)]
    x = array.array("f")
    for label in y:
        x.extend(means[label][j] + rng.gauss(0, 1.5) for j in range(784))
    npy(os.path.join(d, "x.npy"), "<f4", (n, 784), x.tobytes())
    npy(os.path.join(d, "y.npy"), "<i8", (n,), struct.pack("<%dq" % n, *y))
PY
}

# start_split_cloud DIR [ARG]...: `$bin/sparrow-edge serve` on loopback, plain
# TCP, no state file, the MLP cut at fc1 (seed 7, lr 0.05, momentum 0.9, one
# thread), its config DIR/cloud.toml and log DIR/cloud.log, ARGs added (e.g.
# --set lr=0.01). Returns once it listens: cloud_pid (also in `pids`) and
# cloud_endpoint are set; fails the script when it does not start in 60 s.
start_split_cloud() {
  local dir=$1
  shift
  mkdir -p "$dir"
  cat > "$dir/cloud.toml" <<TOML
listen = "tcp://127.0.0.1:*"
state = ""
model = "mlp"
cut = "fc1"
seed = 7
lr = 0.05
momentum = 0.9
grad_norm_factor = 0
threads = 1
TOML
  "$bin/sparrow-edge" serve --config "$dir/cloud.toml" --insecure "$@" > "$dir/cloud.log" 2>&1 &
  cloud_pid=$!
  pids+=("$cloud_pid")
  wait_log "$dir/cloud.log" "event=listening" 60 "$cloud_pid" ||
    { cat "$dir/cloud.log" >&2; fail "$dir: sparrow-edge serve did not start"; }
  cloud_endpoint=$(log_endpoint "$dir/cloud.log")
}
