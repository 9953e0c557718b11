#!/usr/bin/env bash
# Peak RSS of sparrow-client-lite against sparrow-client, each the only client
# of a real sparrow-server (CurveZMQ): the MLP and the CNN, 600 random
# 28x28 samples, 3 rounds, compression = "dgc:ratio=0.01". One JSON line per run:
#   {"model":..,"client":..,"peak_rss_mb":..,"wall_s":..}
# peak_rss_mb: GNU time's maximum resident set size of the client process.
#   bench/lite_client_rss.sh            (from a build in build/; run it under
#                                        the build lock on a shared machine)
# Environment: BIN (default build/bin), MODELS (default "mlp cnn"), KINDS
# ("lite full": sparrow-client-lite, sparrow-client), WRAP (a command the
# client runs under, e.g. "heaptrack -o /tmp/ht"; its RSS then counts too).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "${BIN:-build/bin}" && pwd)
command -v /usr/bin/time > /dev/null || { echo "lite_client_rss: needs GNU time (/usr/bin/time)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/lite_client_rss.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
python3 - "$work" <<'PY'
import array, random, struct, sys, os
root=sys.argv[1]
def npy(path, descr, shape, payload):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (descr, ", ".join(map(str, shape)) + ("," if len(shape) == 1 else ""))
    h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    open(path,"wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + payload)
rng=random.Random(1); n=600
d=os.path.join(root,"d"); os.makedirs(d)
y=[rng.randrange(10) for _ in range(n)]
x=array.array("f",(rng.gauss(0,1) for _ in range(n*784)))
npy(os.path.join(d,"x.npy"),"<f4",(n,1,28,28),x.tobytes())
npy(os.path.join(d,"y.npy"),"<i8",(n,),struct.pack("<%dq"%n,*y))
PY
"$bin/sparrow-server" keygen --out "$work/keys" --clients 1 > /dev/null 2>&1
for model in ${MODELS:-mlp cnn}; do
  "$bin/sparrow-lite-export" --model "$model" -o "$work/$model.lite" > /dev/null
  for kind in ${KINDS:-lite full}; do
    run=$work/$model-$kind
    mkdir -p "$run"
    cat > "$run/server.toml" <<T
listen = "tcp://127.0.0.1:*"
key = "$work/keys/server.key_secret"
allow = "$work/keys/allow.txt"
db = "$run/server.db"
model = "$model"
rounds = 3
clients_per_round = 1
min_clients = 1
compression = "dgc:ratio=0.01"
T
    "$bin/sparrow-server" --config "$run/server.toml" > "$run/server.log" 2>&1 &
    spid=$!
    ep=
    for _ in $(seq 100); do
      ep=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$run/server.log" | head -1 || true)
      [ -n "$ep" ] && break
      sleep 0.1
    done
    [ -n "$ep" ] || { cat "$run/server.log" >&2; echo "lite_client_rss: the server did not start" >&2; exit 1; }
    {
      echo "server = \"$ep\""
      echo "server_key = \"$work/keys/server.key\""
      echo "key = \"$work/keys/client1.key_secret\""
      echo "client_id = \"client1\""
      echo "model = \"$model\""
      echo "data = \"folder:$work/d\""
      if [ "$kind" = lite ]; then
        echo "model_file = \"$work/$model.lite\""
        echo "state_file = \"$run/c.lite\""
      else
        echo "state_db = \"$run/c.db\""
      fi
    } > "$run/c.toml"
    prog=sparrow-client
    [ "$kind" = lite ] && prog=sparrow-client-lite
    # shellcheck disable=SC2086  # WRAP is a command line
    /usr/bin/time -f "%M %e" -o "$run/time.txt" ${WRAP:-} "$bin/$prog" --config "$run/c.toml" > "$run/c.log" 2>&1 ||
      { tail -3 "$run/c.log" >&2; }
    wait "$spid" || true
    read -r rss el < "$run/time.txt"
    echo "{\"model\":\"$model\",\"client\":\"$prog\",\"peak_rss_mb\":$(python3 -c "print(round($rss/1024,1))"),\"wall_s\":$el}"
  done
done
