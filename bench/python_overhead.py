#!/usr/bin/env python3
"""Overhead of driving Sparrow from Python (docs/python.md, "Cost"). One JSON line per measurement.

  PYTHONPATH=build/python python3 bench/python_overhead.py [--rounds 20] [--repeat 3] [--cases cli,hook,step]
                                                           [--models mlp,cnn]

cli:  the same run (examples/fedavg_mnist.toml, `rounds` rounds, one worker) started by
      `sparrow-sim` and by sparrow.Simulation, alternately, `repeat` times each:
      {"case":"cli","runner":"sparrow-sim"|"python","wall_s":..,"rounds_s":..,"import_s":..,"same_model":..}
      wall_s: the whole process (start, data, rounds, exit); rounds_s: the sum of the rounds' real_s;
      import_s: of wall_s, the seconds `import sparrow` took (loading LibTorch's libraries, which
      sparrow-sim loads too; `import sparrow` does not import the torch package).
hook: the built-in coordinate-wise `median` against the same rule as a Python function (numpy),
      same clients and seed, per model:
      {"case":"hook","model":..,"aggregator":..,"round_s":..,"in_python_s":..,"d":..,"n":..,"same_model":..}
      round_s: mean real_s per round; in_python_s: mean seconds per round inside the Python function.
step: the built-in server optimiser `fedavg` against the same step as a Python function (numpy
      w + d), per model: {"case":"step","model":..,"server_optimizer":..,"round_s":..,"in_python_s":..,
      "same_model":..}
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.environ.get("SPARROW_SIM", os.path.join(ROOT, "build", "bin", "sparrow-sim"))
BASE = os.path.join(ROOT, "examples", "fedavg_mnist.toml")


def emit(**kv):
    print(json.dumps(kv), flush=True)


def python_run(cfg_path, out, rounds):
    # A fresh interpreter, as a user starts one: import, build, run.
    code = ("import sys, time, json; t = time.perf_counter(); import sparrow; i = time.perf_counter() - t; "
            "sim = sparrow.Simulation(sys.argv[1], out=sys.argv[2], rounds=int(sys.argv[3]), workers=1); "
            "sim.run(); print(json.dumps([sum(m['real_s'] for m in sim.history()), i]))")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, cfg_path, out, str(rounds)], check=True, capture_output=True,
                       text=True)
    rounds_s, import_s = json.loads(r.stdout.strip().splitlines()[-1])
    return time.perf_counter() - t, rounds_s, import_s


def cli_run(cfg_path, out, rounds):
    t = time.perf_counter()
    subprocess.run([SIM, "--config", cfg_path, "--set", f"out={out}", "--set", f"rounds={rounds}", "--set",
                    "workers=1", "--log-level", "warn"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def case_cli(args, tmp):
    import sparrow

    for i in range(args.repeat):
        for runner in (("sparrow-sim", "python") if i % 2 == 0 else ("python", "sparrow-sim")):
            out = os.path.join(tmp, f"{runner}-{i}")
            import_s = 0.0
            if runner == "python":
                wall, rounds_s, import_s = python_run(BASE, out, args.rounds)
            else:
                wall = cli_run(BASE, out, args.rounds)
                with open(os.path.join(out, "metrics.csv")) as f:
                    import csv

                    rounds_s = sum(float(r["real_s"]) for r in csv.DictReader(f))
            same = None
            other = os.path.join(tmp, f"{'python' if runner == 'sparrow-sim' else 'sparrow-sim'}-{i}")
            if os.path.exists(os.path.join(other, "run.db")):
                a, b = sparrow.load_run_model(out)[0], sparrow.load_run_model(other)[0]
                same = all(bool((a[k] == b[k]).all()) for k in a)
            emit(case="cli", runner=runner, rounds=args.rounds, wall_s=round(wall, 3), rounds_s=round(rounds_s, 3),
                 import_s=round(import_s, 3), same_model=same)


def case_hook(args, tmp):
    import numpy as np

    import sparrow

    spent = []

    def py_median(round, updates):
        t = time.perf_counter()
        out = np.median(np.stack([r.numpy() for r in updates.rows]), axis=0)
        spent.append(time.perf_counter() - t)
        return out

    sparrow.register_aggregator("bench_py_median", py_median)
    for model in args.models.split(","):
        models = {}
        for agg in ("median", "bench_py_median"):
            spent.clear()
            out = os.path.join(tmp, f"{model}-{agg}")
            sim = sparrow.Simulation(BASE, out=out, rounds=args.rounds, model=model, aggregator=agg, workers=1,
                                     eval_every=0)
            sim.run()
            per_round = statistics.mean(m["real_s"] for m in sim.history())
            models[agg] = sim.model()
            d = sum(t.numel() for t in models[agg].values())
            same = None
            if len(models) == 2:
                a, b = models["median"], models[agg]
                same = all(bool((a[k] == b[k]).all()) for k in a)
            emit(case="hook", model=model, aggregator=agg, rounds=args.rounds, round_s=round(per_round, 4),
                 in_python_s=round(statistics.mean(spent), 4) if spent else 0.0, d=d,
                 n=sim.history()[0]["clients"], same_model=same)
            sim.close()


def case_step(args, tmp):
    import sparrow

    spent = []

    def py_fedavg(round, weights, aggregate):
        t = time.perf_counter()
        out = {n: w.numpy() + aggregate[n].numpy() for n, w in weights.items()}
        spent.append(time.perf_counter() - t)
        return out

    sparrow.register_server_optimizer("bench_py_fedavg", py_fedavg)
    for model in args.models.split(","):
        models = {}
        for opt in ("fedavg", "bench_py_fedavg"):
            spent.clear()
            sim = sparrow.Simulation(BASE, out=os.path.join(tmp, f"step-{model}-{opt}"), rounds=args.rounds,
                                     model=model, server_optimizer=opt, workers=1, eval_every=0)
            sim.run()
            models[opt] = sim.model()
            same = None
            if len(models) == 2:
                a, b = models["fedavg"], models[opt]
                same = all(bool((a[k] == b[k]).all()) for k in a)
            emit(case="step", model=model, server_optimizer=opt, rounds=args.rounds,
                 round_s=round(statistics.mean(m["real_s"] for m in sim.history()), 4),
                 in_python_s=round(statistics.mean(spent), 4) if spent else 0.0, same_model=same)
            sim.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default="cli,hook,step")
    p.add_argument("--models", default="mlp,cnn")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="sparrow_pybench_")
    try:
        for case in args.cases.split(","):
            {"cli": case_cli, "hook": case_hook, "step": case_step}[case](args, tmp)
    finally:
        shutil.rmtree(tmp, True)


if __name__ == "__main__":
    main()
