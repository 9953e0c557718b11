#!/usr/bin/env python3
"""Time to accuracy on the simulated clock: the asynchronous-vs-synchronous study of docs/results.md.

    scripts/async_study.py tune --async ASYNC_SWEEP_DIR SYNC_SWEEP_DIR... [--budget 1000]
    scripts/async_study.py final SWEEP_DIR --sync NAME --async NAME [--plain NAME] [--budget 1000]

The runs themselves are scripts/sweep.py grids over examples/async/fmnist_1000.toml (the
commands are in docs/results.md and in `reproduce` below); this script scores them.

Every run is cut at the same simulated time, `--budget` seconds (the clock is the cumulative
`sim_round_s` of metrics.csv: device and network profiles, synchronous rounds or asynchronous
steps alike), so a configuration that steps faster is not given more time:
  final accuracy   the mean of the evaluations in the last 10% of the budget, (0.9 T, T]
                   (one evaluation is noisy at this skew; the mean of ~7 is what the run has
                   reached, not where it happened to be);
  time to target   the simulated time of the first evaluation at or above the target, the
                   synchronous run's final accuracy of the same seed (`-`: not within T);
                   `smoothed`: the first time the mean of the last 3 evaluations reaches it.
For the synchronous run itself, the time to its own final accuracy is its own first crossing
(that is what sparrow-sim report's runs table shows too).

tune:  sync configurations are ranked by validation final accuracy; the best one's is the
       target; async configurations by their time to that target among those whose final
       accuracy is within 1 point of it (the goal), else by final accuracy.
final: per seed (paired), the target is the tuned synchronous run's final accuracy; prints the
       speed-up sync time / async time and the finals with 95% t-intervals over seeds.
Standard library only.
"""

import argparse
import csv
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep import mean_ci, slug  # noqa: E402  (the sweep harness's own statistics)


def curve(run_dir):
    """[(simulated seconds at the end of the row, accuracy)] for the evaluated rows, and the run's end."""
    pts, clock = [], 0.0
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        for r in csv.DictReader(f):
            clock += float(r["sim_round_s"])
            if r["accuracy"] not in ("", "nan"):
                pts.append((clock, float(r["accuracy"])))
    return pts, clock


def final_accuracy(pts, budget):
    window = [a for t, a in pts if 0.9 * budget < t <= budget]
    return sum(window) / len(window) if window else float("nan")


def time_to(pts, target, budget, smooth=1):
    for i in range(len(pts)):
        t = pts[i][0]
        if t > budget:
            break
        if i + 1 < smooth:
            continue
        acc = sum(a for _, a in pts[i + 1 - smooth:i + 1]) / smooth
        if acc >= target:
            return t
    return float("nan")


def load(sweep_dir, name, seed, budget):
    run = os.path.join(sweep_dir, slug(name), f"seed{seed}")
    pts, end = curve(run)
    if end < budget:
        print(f"async_study: warning: {run} ends at {end:.0f} simulated s, before the budget {budget:.0f} s",
              file=sys.stderr)
    return pts


def methods(sweep_dir):
    return sorted(d for d in os.listdir(sweep_dir) if os.path.isdir(os.path.join(sweep_dir, d)))


def seeds_of(sweep_dir, method_slug):
    """The seeds of a method whose run folder holds metrics.csv."""
    folder = os.path.join(sweep_dir, method_slug)
    return sorted(int(d[4:]) for d in os.listdir(folder)
                  if d.startswith("seed") and os.path.isfile(os.path.join(folder, d, "metrics.csv")))


def fmt_s(t):
    return "-" if t != t else f"{t:.0f}"


def ratio(a, b):
    return "-" if a != a or b != b else f"{a / b:.2f}x"


def tune(args):
    budget = args.budget
    rows = []
    for d in args.sync_dirs:
        for m in methods(d):
            pts = load(d, m, 1, budget)
            rows.append((final_accuracy(pts, budget), m, pts))
    rows.sort(key=lambda r: -r[0] if r[0] == r[0] else 1)
    target = rows[0][0]
    print(f"Synchronous, validation, budget {budget:.0f} simulated s (final = mean of the evaluations in "
          f"({0.9 * budget:.0f}, {budget:.0f}] s):\n")
    print("| configuration | final accuracy % | simulated s to own final |\n|---|---|---|")
    for acc, m, pts in rows:
        print(f"| {m} | {100 * acc:.2f} | {fmt_s(time_to(pts, acc, budget))} |")
    print(f"\nChosen: {rows[0][1]}; target {100 * target:.2f}%, reached at "
          f"{fmt_s(time_to(rows[0][2], target, budget))} s.\n")
    arows = []
    for m in methods(args.async_dir):
        pts = load(args.async_dir, m, 1, budget)
        arows.append((final_accuracy(pts, budget), time_to(pts, target, budget), time_to(pts, target, budget, 3), m))
    ok = [r for r in arows if r[0] >= target - 0.01 and r[1] == r[1]]
    ranked = sorted(ok, key=lambda r: r[1]) + sorted([r for r in arows if r not in ok], key=lambda r: -r[0])
    print(f"Asynchronous, validation, target {100 * target:.2f}%:\n")
    print("| configuration | final accuracy % | simulated s to target | smoothed |\n|---|---|---|---|")
    for acc, t, ts, m in ranked:
        print(f"| {m} | {100 * acc:.2f} | {fmt_s(t)} | {fmt_s(ts)} |")
    print(f"\nChosen: {ranked[0][3]}")


def final(args):
    budget, d = args.budget, args.dir
    sync, asyn = slug(args.sync), slug(args.async_)
    names = [sync, asyn] + ([slug(args.plain)] if args.plain else [])
    seeds = sorted(set.intersection(*(set(seeds_of(d, n)) for n in names)))
    per = []
    for s in seeds:
        ps, pa = load(d, sync, s, budget), load(d, asyn, s, budget)
        target = final_accuracy(ps, budget)
        row = {"seed": s, "target": target, "sync_t": time_to(ps, target, budget),
               "async_t": time_to(pa, target, budget), "sync_t3": time_to(ps, target, budget, 3),
               "async_t3": time_to(pa, target, budget, 3), "sync_acc": target,
               "async_acc": final_accuracy(pa, budget)}
        if args.plain:
            pp = load(d, slug(args.plain), s, budget)
            row["plain_acc"] = final_accuracy(pp, budget)
            row["plain_t"] = time_to(pp, target, budget)
            row["async_t_plain"] = time_to(pa, row["plain_acc"], budget)
            row["plain_t_own"] = time_to(pp, row["plain_acc"], budget)
        per.append(row)
    print(f"Test set, budget {budget:.0f} simulated s; sync = {args.sync}, async = {args.async_}"
          + (f", plain = {args.plain}" if args.plain else "") + "\n")
    head = "| seed | target (sync final) % | sync s | async s | speed-up | smoothed: sync s | async s | async final % |"
    if args.plain:
        head += " plain final % | plain s to target | async s to plain final | plain s to own final |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in per:
        line = (f"| {r['seed']} | {100 * r['target']:.2f} | {fmt_s(r['sync_t'])} | {fmt_s(r['async_t'])} | "
                f"{ratio(r['sync_t'], r['async_t'])} | {fmt_s(r['sync_t3'])} | {fmt_s(r['async_t3'])} | "
                f"{100 * r['async_acc']:.2f} |")
        if args.plain:
            line += (f" {100 * r['plain_acc']:.2f} | {fmt_s(r['plain_t'])} | {fmt_s(r['async_t_plain'])} | "
                     f"{fmt_s(r['plain_t_own'])} |")
        print(line)

    def ci(xs, scale=1.0, unit=""):
        xs = [x * scale for x in xs if x == x]
        m, h = mean_ci(xs)
        return f"{m:.2f} ± {h:.2f}{unit} (n = {len(xs)})"

    print()
    print("speed-up, sync s / async s, first crossing:", ci([r["sync_t"] / r["async_t"] for r in per], unit="x"))
    print("speed-up, smoothed (mean of 3 evaluations):", ci([r["sync_t3"] / r["async_t3"] for r in per], unit="x"))
    print("sync final %:", ci([r["sync_acc"] for r in per], 100))
    print("async final %:", ci([r["async_acc"] for r in per], 100))
    print("async - sync, points (paired):", ci([r["async_acc"] - r["sync_acc"] for r in per], 100))
    if args.plain:
        print("plain sync final %:", ci([r["plain_acc"] for r in per], 100))
        print("speed-up vs plain sync, to plain's final:",
              ci([r["plain_t_own"] / r["async_t_plain"] for r in per], unit="x"))
        print("async - plain sync, points (paired):", ci([r["async_acc"] - r["plain_acc"] for r in per], 100))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    t.add_argument("--async", dest="async_dir", required=True)
    t.add_argument("sync_dirs", nargs="+")
    t.add_argument("--budget", type=float, default=1000)
    f = sub.add_parser("final")
    f.add_argument("dir")
    f.add_argument("--sync", required=True)
    f.add_argument("--async", dest="async_", required=True)
    f.add_argument("--plain")
    f.add_argument("--budget", type=float, default=1000)
    args = ap.parse_args()
    tune(args) if args.cmd == "tune" else final(args)


if __name__ == "__main__":
    main()
