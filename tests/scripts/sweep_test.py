#!/usr/bin/env python3
"""scripts/sweep.py against real sparrow-sim runs (ctest: sweep_harness).

    tests/scripts/sweep_test.py SPARROW_SIM_BINARY

A tiny grid (synthetic data, logistic regression, 3 rounds, 2 methods x 3 seeds):
checks that every run ran with its seed and overrides, that the same seed gives the
same client selection for both methods, that summary.csv's means, 95% t-intervals and
paired differences and the byte reductions (uplink, downlink, total) equal what
the runs' metrics.csv give, that an interrupted sweep
resumes without running finished runs again, and that bad grids are refused.
"""

import csv
import math
import os
import shutil
import subprocess
import sys
import tempfile
import xml.dom.minidom

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "scripts", "sweep.py")
T95_2DF = 4.303  # two-sided 95% t quantile, 2 degrees of freedom


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)


def run(args, expect=0):
    r = subprocess.run([sys.executable, SWEEP] + args, capture_output=True, text=True)
    check(r.returncode == expect, f"sweep.py {args} exited {r.returncode}, wanted {expect}:\n{r.stdout}\n{r.stderr}")
    return r


def metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    sim = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="sweep_test_")
    try:
        base = os.path.join(tmp, "base.toml")
        with open(base, "w") as f:
            f.write('dataset = "synthetic:alpha=1,beta=1"\nclients = 8\nclients_per_round = 3\nrounds = 3\n'
                    'model = "logreg"\nbatch_size = 16\nlr = 0.05\neval_every = 1\nworkers = 1\n')
        grid = os.path.join(tmp, "grid.toml")
        with open(grid, "w") as f:
            f.write(f'base = "{base}"\nseeds = [1, 2, 3]\nset = ["rounds=3"]\nlast = 2\nreference = "dense"\n'
                    '[[method]]\nname = "dense"\nset = ["compression=none"]\n'
                    '[[method]]\nname = "stc 0.1"\nset = ["compression=stc:ratio=0.1"]\n')
        out = os.path.join(tmp, "out")
        r = run([grid, "--out", out, "--sim", sim])
        check(r.stdout.count(": ran in") == 6, f"six runs, got:\n{r.stdout}")

        # Each run: its seed and overrides, 3 rounds.
        runs = {}
        for method, slug in (("dense", "dense"), ("stc 0.1", "stc_0.1")):
            for seed in (1, 2, 3):
                d = os.path.join(out, slug, f"seed{seed}")
                with open(os.path.join(d, "config.toml")) as f:
                    cfg = f.read()
                check(f"seed = {seed}\n" in cfg, f"{d}: seed {seed} in config.toml")
                want = '"stc:ratio=0.1"' if slug != "dense" else '"none"'
                check(f"compression = {want}" in cfg, f"{d}: compression {want}")
                runs[(method, seed)] = metrics(os.path.join(d, "metrics.csv"))
                check(len(runs[(method, seed)]) == 3, f"{d}: 3 rounds")
        # STC sends far fewer uplink bytes than dense for every seed.
        for seed in (1, 2, 3):
            up_dense = sum(int(r["bytes_up"]) for r in runs[("dense", seed)])
            up_stc = sum(int(r["bytes_up"]) for r in runs[("stc 0.1", seed)])
            check(up_stc * 3 < up_dense, f"seed {seed}: stc sends fewer bytes ({up_stc} vs {up_dense})")

        # summary.csv against the metrics.
        acc = {k: sum(float(r["accuracy"]) for r in v[-2:]) / 2 for k, v in runs.items()}
        with open(os.path.join(out, "summary.csv"), newline="") as f:
            rows = {r["method"]: r for r in csv.DictReader(f)}
        check(set(rows) == {"dense", "stc 0.1"}, f"summary rows {sorted(rows)}")
        for method in ("dense", "stc 0.1"):
            xs = [100 * acc[(method, s)] for s in (1, 2, 3)]
            m = sum(xs) / 3
            half = T95_2DF * math.sqrt(sum((x - m) ** 2 for x in xs) / 2 / 3)
            check(abs(float(rows[method]["accuracy"]) - m) < 1e-6, f"{method}: mean {rows[method]['accuracy']} vs {m}")
            check(abs(float(rows[method]["ci95"]) - half) < 1e-6, f"{method}: ci {rows[method]['ci95']} vs {half}")
            ds = [100 * (acc[(method, s)] - acc[("dense", s)]) for s in (1, 2, 3)]
            check(abs(float(rows[method]["diff"]) - sum(ds) / 3) < 1e-6, f"{method}: paired difference")
            up = sum(sum(int(r["bytes_up"]) for r in runs[(method, s)]) for s in (1, 2, 3)) / 3
            check(abs(float(rows[method]["bytes_up"]) - up) < 1e-3, f"{method}: uplink bytes")
        check(float(rows["dense"]["diff"]) == 0.0, "reference differs from itself by 0")
        check(float(rows["stc 0.1"]["uplink_reduction"]) > 3, "stc uplink reduction")
        # The reductions both ways and in total: the reference's mean bytes over the
        # same seeds divided by the method's.
        def mean_bytes(method, key):
            return sum(sum(int(r[key]) for r in runs[(method, s)]) for s in (1, 2, 3)) / 3
        for key, col in (("bytes_up", "uplink_reduction"), ("bytes_down", "downlink_reduction")):
            want = mean_bytes("dense", key) / mean_bytes("stc 0.1", key)
            check(abs(float(rows["stc 0.1"][col]) - want) < 1e-6 * want, f"stc {col} {rows['stc 0.1'][col]} vs {want}")
        tot = lambda m: mean_bytes(m, "bytes_up") + mean_bytes(m, "bytes_down")
        want = tot("dense") / tot("stc 0.1")
        check(abs(float(rows["stc 0.1"]["total_reduction"]) - want) < 1e-6 * want, "stc total_reduction")
        check(1 < want < float(rows["stc 0.1"]["uplink_reduction"]), f"dense downlink: total reduction {want} below the uplink's")
        check(float(rows["dense"]["total_reduction"]) == 1.0, "reference's total reduction is 1")
        with open(os.path.join(out, "summary.md")) as f:
            md = f.read()
        check("| stc 0.1 | 3 |" in md, "summary.md has the stc row")
        check("| total bytes / run |" in md, "summary.md has a total bytes column")
        check("| fewer downlink bytes |" in md and "| fewer total bytes |" in md, "summary.md has the reductions")
        for method in ("dense", "stc 0.1"):
            up, down, total = (float(rows[method][k]) for k in ("bytes_up", "bytes_down", "bytes_total"))
            check(abs(up + down - total) < 1e-3, f"{method}: total = uplink + downlink")
        with open(os.path.join(out, "runs.csv"), newline="") as f:
            for r in csv.DictReader(f):
                check(int(r["bytes_total"]) == int(r["bytes_up"]) + int(r["bytes_down"]), "runs.csv bytes_total")
        for name in ("plot.svg", "plot_total.svg"):
            svg = xml.dom.minidom.parse(os.path.join(out, name))
            marks = {}
            for c in svg.getElementsByTagName("circle"):
                marks[c.getAttribute("class")] = marks.get(c.getAttribute("class"), 0) + 1
            check(marks == {"mean": 2, "legend": 2, "seed": 6}, f"{name}: a mean, a legend mark, 3 seeds per method: {marks}")
            ticks = [int(t.firstChild.data.rstrip("%")) for t in svg.getElementsByTagName("text")
                     if t.getAttribute("class") == "y-tick"]
            check(ticks and 0 <= min(ticks) and max(ticks) <= 100, f"{name}: y ticks within 0-100%: {ticks}")

        # Two seeds: a 95% interval of 12.7 standard errors never stretches the axis past 0-100%.
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        import sweep
        two = os.path.join(tmp, "two.svg")
        sweep.write_svg(two, [("a", 1e6, 96.0, 60.0, [94.0, 98.0]), ("b", 1e4, 80.0, 40.0, [78.0, 82.0])], "t", "x")
        svg = xml.dom.minidom.parse(two)
        ticks = [int(t.firstChild.data.rstrip("%")) for t in svg.getElementsByTagName("text")
                 if t.getAttribute("class") == "y-tick"]
        check(max(ticks) <= 100 and min(ticks) >= 70, f"two seeds: the axis follows the seeds, within 100%: {ticks}")
        note = [t.firstChild.data for t in svg.getElementsByTagName("text") if t.getAttribute("class") == "note"]
        check(note and "2 seeds" in note[0] and "past the axis" in note[0], f"two seeds: the note says so: {note}")

        # Resume: a removed run is run again, the others are not.
        shutil.rmtree(os.path.join(out, "stc_0.1", "seed2"))
        r = run([grid, "--out", out, "--sim", sim])
        check(r.stdout.count(": ran in") == 1 and r.stdout.count("done before") == 5, f"resume:\n{r.stdout}")

        # Bad grids: unknown keys, a reference that is no method, a failing run.
        bad = os.path.join(tmp, "bad.toml")
        for text, fragment in (
            (f'base = "{base}"\nsedes = [1]\n[[method]]\nname = "a"\n', "unknown keys"),
            (f'base = "{base}"\nreference = "b"\n[[method]]\nname = "a"\n', "reference 'b' is not a method"),
            (f'base = "{base}"\nseeds = [1]\n[[method]]\nname = "a"\nset = ["nonsense=1"]\n', "run failed"),
        ):
            with open(bad, "w") as f:
                f.write(text)
            r = run([bad, "--out", os.path.join(tmp, "bad_out"), "--sim", sim], expect=2)
            check(fragment in r.stderr, f"bad grid: '{fragment}' in {r.stderr!r}")
        print("sweep harness: all checks passed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
