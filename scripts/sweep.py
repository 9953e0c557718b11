#!/usr/bin/env python3
"""Runs a grid of sparrow-sim methods x seeds and summarises it (docs/results.md).

    scripts/sweep.py GRID.toml [--out DIR] [--seeds 1,2,3] [--only NAME,...] [--dry-run]
                               [--sim build/bin/sparrow-sim]

GRID.toml:
    base = "examples/sweep/fmnist_mlp.toml"   # sparrow-sim config every run starts from
    seeds = [1, 2, 3, 4, 5]
    set = ["rounds=200"]                     # overrides for every run
    last = 10                                # evaluations averaged into a run's accuracy
    reference = "dense"                      # method the differences are taken against
    [[method]]
    name = "dense"
    set = ["compression=none"]
    [[method]]
    name = "stc 0.005"
    set = ["compression=stc:ratio=0.005"]

Every method runs with the same seeds, so with the same data partition and the same
clients in every round (sparrow-sim draws both from the seed alone): differences
between methods are paired by seed. A run whose metrics.csv already holds every round
is not run again, so an interrupted sweep resumes where it stopped.

Writes into --out (default runs/sweep-<grid stem>):
    runs.csv     one row per run: accuracy (mean of the last `last` evaluations),
                 final accuracy, uplink, downlink and total wire bytes, seconds
    summary.csv  one row per method: mean over seeds with a 95% t-interval, the
                 paired difference to `reference` with its 95% t-interval, the
                 mean uplink, downlink and total bytes, and how many times fewer
                 each is than the reference's over the same seeds
                 (uplink_reduction, downlink_reduction, total_reduction)
    summary.md   the same as a Markdown table
    plot.svg     accuracy (mean, 95% interval, and each seed as a hollow mark) against
                 uplink bytes (--x total: uplink + downlink), log scale, one point per
                 method; the y axis stays within 0-100% and is scaled to the seeds'
                 values, an interval wider than the axis (2 seeds: t = 12.7) is cut at
                 its edge and said so; no plotting library needed
    plot_total.svg  the same against uplink + downlink bytes (with --x up)
Standard library only.
"""

import argparse
import csv
import math
import os
import shlex
import subprocess
import sys
import time
import tomllib

# Two-sided 95% Student t quantiles, df = 1..30 (df > 30: 1.96 is within 2%).
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df):
    if df < 1:
        return float("nan")
    return T95[df - 1] if df <= len(T95) else 1.96


def mean_ci(xs):
    """Mean and half-width of the 95% t-interval (nan with one sample)."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, t95(n - 1) * math.sqrt(var / n)


def fail(msg):
    print(f"sweep: {msg}", file=sys.stderr)
    sys.exit(2)


def load_grid(path):
    try:
        with open(path, "rb") as f:
            g = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        fail(f"{path}: {e}")
    known = {"base", "seeds", "set", "last", "reference", "method"}
    unknown = set(g) - known
    if unknown:
        fail(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    if "base" not in g or not g.get("method"):
        fail(f"{path}: needs 'base' and at least one [[method]]")
    names = set()
    for m in g["method"]:
        if set(m) - {"name", "set"} or "name" not in m:
            fail(f"{path}: each [[method]] has a name and optionally set = [...], got {sorted(m)}")
        if m["name"] in names:
            fail(f"{path}: method '{m['name']}' twice")
        names.add(m["name"])
        m.setdefault("set", [])
    g.setdefault("seeds", [1, 2, 3, 4, 5])
    g.setdefault("set", [])
    g.setdefault("last", 10)
    if g.get("reference") and g["reference"] not in names:
        fail(f"{path}: reference '{g['reference']}' is not a method")
    return g


def slug(name):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def read_metrics(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append(r)
    return rows


def expected_rounds(sim, config, overrides):
    """The run's `rounds` as sparrow-sim resolves it (file, then overrides)."""
    rounds = None
    for o in overrides:
        if o.startswith("rounds="):
            rounds = int(o.split("=", 1)[1])
    if rounds is None:
        with open(config, "rb") as f:
            rounds = int(tomllib.load(f).get("rounds", 10))
    return rounds


def run_one(args, grid, method, seed, out_dir):
    run_dir = os.path.join(out_dir, slug(method["name"]), f"seed{seed}")
    overrides = list(grid["set"]) + list(method["set"]) + [f"seed={seed}", f"out={run_dir}"]
    rounds = expected_rounds(args.sim, grid["base"], overrides)
    metrics = os.path.join(run_dir, "metrics.csv")
    cmd = [args.sim, "--config", grid["base"]] + sum((["--set", o] for o in overrides), [])
    if os.path.exists(metrics) and len(read_metrics(metrics)) >= rounds:
        return run_dir, 0.0, "done before"
    if args.dry_run:
        print(" ".join(shlex.quote(c) for c in cmd))
        return run_dir, 0.0, "dry run"
    if os.path.exists(run_dir):  # an interrupted run: start it again
        subprocess.run(["rm", "-rf", run_dir], check=True)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    t0 = time.time()
    with open(os.path.join(os.path.dirname(run_dir), f"seed{seed}.log"), "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    dt = time.time() - t0
    if r.returncode != 0:
        fail(f"run failed (exit {r.returncode}): {' '.join(shlex.quote(c) for c in cmd)}; "
             f"see {os.path.dirname(run_dir)}/seed{seed}.log")
    return run_dir, dt, "ran"


def summarise_run(run_dir, last):
    rows = read_metrics(os.path.join(run_dir, "metrics.csv"))
    evals = [float(r["accuracy"]) for r in rows if r["accuracy"] not in ("", "nan")]
    if not evals:
        fail(f"{run_dir}: no evaluation in metrics.csv")
    tail = evals[-last:]
    return {
        "accuracy": sum(tail) / len(tail),
        "final_accuracy": evals[-1],
        "evaluations": len(tail),
        "bytes_up": sum(int(r["bytes_up"]) for r in rows),
        "bytes_down": sum(int(r["bytes_down"]) for r in rows),
        "rounds": len(rows),
        "real_s": sum(float(r["real_s"]) for r in rows),
    }


def fmt_bytes(b):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def write_svg(path, points, title, xlabel):
    """points: [(label, bytes, mean, half, seed values)] with mean/half/values in percent.

    The y axis covers the means and every seed's value (not the intervals, which
    with 2 seeds are 12.7 standard errors wide), within 0-100%; an interval that
    leaves the axis is drawn to its edge without a cap there."""
    W, H, L, R, T, B = 760, 480, 70, 190, 40, 80
    xs = [math.log10(max(p[1], 1)) for p in points]
    ys = [p[2] for p in points] + [v for p in points for v in p[4]]
    lo_y, hi_y = max(0.0, min(ys)), min(100.0, max(ys))
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs))
    if x1 == x0:
        x1 = x0 + 1
    pad = max(0.5, 0.08 * (hi_y - lo_y))
    y0, y1 = max(0, math.floor(lo_y - pad)), min(100, math.ceil(hi_y + pad))
    if y1 <= y0:
        y0, y1 = max(0, y0 - 1), min(100, y1 + 1)
    px = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    py = lambda y: T + (y1 - min(max(y, y0), y1)) / (y1 - y0) * (H - T - B)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf"]
    esc = lambda t: str(t).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{esc(title)}</text>']
    for d in range(x0, x1 + 1):
        X = px(d)
        out.append(f'<line x1="{X:.1f}" y1="{T}" x2="{X:.1f}" y2="{H - B}" stroke="#ddd"/>')
        out.append(f'<text x="{X:.1f}" y="{H - B + 18}" text-anchor="middle">{fmt_bytes(10 ** d)}</text>')
    step = max(1, round((y1 - y0) / 8))
    for y in range(y0, y1 + 1, step):
        Y = py(y)
        out.append(f'<line x1="{L}" y1="{Y:.1f}" x2="{W - R}" y2="{Y:.1f}" stroke="#ddd"/>')
        out.append(f'<text class="y-tick" x="{L - 8}" y="{Y + 4:.1f}" text-anchor="end">{y}%</text>')
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - B + 40}" text-anchor="middle">{esc(xlabel)}</text>')
    out.append(f'<text x="18" y="{(T + H - B) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(T + H - B) / 2})">accuracy, mean of the last evaluations</text>')
    seeds = sorted({len(p[4]) for p in points})
    cut = False
    for i, (label, b, m, h, vals) in enumerate(points):
        c = colors[i % len(colors)]
        X, Y = px(math.log10(max(b, 1))), py(m)
        if h == h:
            top, bottom = m + h, m - h
            out.append(f'<line class="ci" x1="{X:.1f}" y1="{py(bottom):.1f}" x2="{X:.1f}" y2="{py(top):.1f}" '
                       f'stroke="{c}" stroke-width="2"/>')
            for yy in (bottom, top):
                if y0 <= yy <= y1:
                    out.append(f'<line x1="{X - 5:.1f}" y1="{py(yy):.1f}" x2="{X + 5:.1f}" y2="{py(yy):.1f}" stroke="{c}"/>')
                else:
                    cut = True
        for v in vals:
            out.append(f'<circle class="seed" cx="{X + 9:.1f}" cy="{py(v):.1f}" r="2.5" fill="white" stroke="{c}"/>')
        out.append(f'<circle class="mean" cx="{X:.1f}" cy="{Y:.1f}" r="4.5" fill="{c}"/>')
        ly = T + 16 + 18 * i
        out.append(f'<circle class="legend" cx="{W - R + 16}" cy="{ly - 4}" r="4.5" fill="{c}"/>')
        out.append(f'<text x="{W - R + 26}" y="{ly}">{esc(label)}</text>')
    note = ("mean of " + "/".join(str(n) for n in seeds) + " seeds, bar: 95% t-interval, hollow: each seed" +
            ("; bars without a cap run past the axis" if cut else ""))
    out.append(f'<text class="note" x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle" fill="#555">{note}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grid")
    ap.add_argument("--out")
    ap.add_argument("--seeds", help="comma-separated seeds (default: the grid's)")
    ap.add_argument("--only", help="comma-separated method names to run (all are summarised if present)")
    ap.add_argument("--sim", default="build/bin/sparrow-sim")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the runs not done yet")
    ap.add_argument("--title", default=None)
    ap.add_argument("--x", choices=["up", "total"], default="up",
                    help="plot against uplink bytes (default) or uplink + downlink bytes")
    args = ap.parse_args()
    grid = load_grid(args.grid)
    if args.seeds:
        grid["seeds"] = [int(s) for s in args.seeds.split(",")]
    out_dir = args.out or os.path.join("runs", "sweep-" + os.path.splitext(os.path.basename(args.grid))[0])
    if not args.dry_run and not os.access(args.sim, os.X_OK):
        fail(f"{args.sim} is not an executable (build first: scripts/build.sh)")
    only = set(args.only.split(",")) if args.only else None
    if only and only - {m["name"] for m in grid["method"]}:
        fail(f"--only names unknown methods: {sorted(only - {m['name'] for m in grid['method']})}")
    os.makedirs(out_dir, exist_ok=True)

    results = {}  # name -> {seed: summary}
    for m in grid["method"]:
        for seed in grid["seeds"]:
            run_dir = os.path.join(out_dir, slug(m["name"]), f"seed{seed}")
            if only is None or m["name"] in only:
                run_dir, dt, how = run_one(args, grid, m, seed, out_dir)
                print(f"sweep: {m['name']} seed {seed}: {how}" + (f" in {dt:.1f} s" if dt else ""), flush=True)
            if os.path.exists(os.path.join(run_dir, "metrics.csv")) and not args.dry_run:
                results.setdefault(m["name"], {})[seed] = summarise_run(run_dir, grid["last"])
    if args.dry_run:
        return

    with open(os.path.join(out_dir, "runs.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "accuracy", "final_accuracy", "evaluations", "rounds", "bytes_up", "bytes_down",
                    "bytes_total", "real_s"])
        for name, by_seed in results.items():
            for seed, r in sorted(by_seed.items()):
                w.writerow([name, seed, f"{r['accuracy']:.6f}", f"{r['final_accuracy']:.6f}", r["evaluations"],
                           r["rounds"], r["bytes_up"], r["bytes_down"], r["bytes_up"] + r["bytes_down"],
                           f"{r['real_s']:.2f}"])

    ref = grid.get("reference")
    ref_runs = results.get(ref, {}) if ref else {}
    rows = []
    for m in grid["method"]:
        by_seed = results.get(m["name"])
        if not by_seed:
            continue
        acc = [100 * r["accuracy"] for r in by_seed.values()]
        mean, half = mean_ci(acc)
        up = sum(r["bytes_up"] for r in by_seed.values()) / len(by_seed)
        down = sum(r["bytes_down"] for r in by_seed.values()) / len(by_seed)
        nan = float("nan")
        diff, dhalf, ratio, down_ratio, total_ratio = nan, nan, nan, nan, nan
        paired = [s for s in by_seed if s in ref_runs]
        if ref and paired:
            diff, dhalf = mean_ci([100 * (by_seed[s]["accuracy"] - ref_runs[s]["accuracy"]) for s in paired])
            ref_up = sum(ref_runs[s]["bytes_up"] for s in paired) / len(paired)
            ref_down = sum(ref_runs[s]["bytes_down"] for s in paired) / len(paired)
            ratio = ref_up / up if up else nan
            down_ratio = ref_down / down if down else nan
            total_ratio = (ref_up + ref_down) / (up + down) if up + down else nan
        rows.append({"method": m["name"], "set": " ".join(m["set"]), "seeds": len(by_seed), "accuracy": mean,
                     "ci95": half, "diff": diff, "diff_ci95": dhalf, "bytes_up": up, "bytes_down": down,
                     "bytes_total": up + down, "uplink_reduction": ratio, "downlink_reduction": down_ratio,
                     "total_reduction": total_ratio, "acc_seeds": acc})

    with open(os.path.join(out_dir, "summary.csv"), "w", newline="") as f:
        fields = [k for k in rows[0].keys() if k != "acc_seeds"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    f2 = lambda x: "–" if x != x else f"{x:.2f}"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(f"Accuracy: mean over seeds of each run's mean of its last {grid['last']} evaluations, "
                f"± the 95% t-interval; difference to `{ref}` paired by seed.\n\n")
        f.write(f"| method | seeds | accuracy % | vs {ref} (points) | uplink bytes / run | fewer uplink bytes | "
                "downlink bytes / run | fewer downlink bytes | total bytes / run | fewer total bytes | `--set` |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n")
        times = lambda x: "–" if x != x else f"{x:.1f}×"
        for r in rows:
            d = "–" if r["diff"] != r["diff"] else f"{r['diff']:+.2f} ± {f2(r['diff_ci95'])}"
            f.write(f"| {r['method']} | {r['seeds']} | {r['accuracy']:.2f} ± {f2(r['ci95'])} | {d} | "
                    f"{fmt_bytes(r['bytes_up'])} | {times(r['uplink_reduction'])} | {fmt_bytes(r['bytes_down'])} | "
                    f"{times(r['downlink_reduction'])} | {fmt_bytes(r['bytes_total'])} | "
                    f"{times(r['total_reduction'])} | `{r['set']}` |\n")
    title = args.title or os.path.basename(args.grid)
    written = ["plot.svg"]
    for name, total in (("plot.svg", args.x == "total"), ("plot_total.svg", True)):
        if name == "plot_total.svg" and args.x == "total":
            continue  # plot.svg is already against the total
        points = [(r["method"], r["bytes_total"] if total else r["bytes_up"], r["accuracy"], r["ci95"],
                   r["acc_seeds"]) for r in rows]
        xlabel = ("total wire bytes per run, uplink + downlink" if total else "uplink wire bytes per run") + \
            " (log scale)"
        write_svg(os.path.join(out_dir, name), points, title, xlabel)
        if name != "plot.svg":
            written.append(name)
    with open(os.path.join(out_dir, "summary.md")) as f:
        sys.stdout.write(f.read())
    print(f"sweep: wrote {out_dir}/runs.csv, summary.csv, summary.md, {', '.join(written)}")


if __name__ == "__main__":
    main()
