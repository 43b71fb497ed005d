#!/usr/bin/env python3
"""Two or more builds' `hydrahead bench gdn --json` runs side by side (scripts/gpu/ab-bench).

    python3 scripts/gpu/ab_summary.py NAME=RUN.json[,RUN.json...] NAME=... [--key fwd_bwd]

Each RUN.json holds the JSON line of one `bench gdn` run (other lines are skipped). For every shape
the runs share, each build's back-to-back figures of the default path are listed: the row's own
(`fwd_bwd_b2b_ms`) and the default side of each comparison the bench alternated with it (scan a head
a block, products by warpgroup, the direct term in the scan, U and Qd/kdecay formed in the scan,
chunk_backward a block a chunk; each side starts from a rested device, docs/BENCHMARKS.md v85), then
their mean, and the mean's difference from the first build's. "all below" (or "all above") says that
every one of a build's figures is under (over) every one of the first build's: the runs of the two
builds overlap nowhere. --key fwd takes the forward's figures instead of forward + backward's.

Below each build after the first, its runs are paired with the first build's in order (ab-bench times the
builds in turn, so run r of each lies side by side in time): each pair's difference of the runs' means, their
mean, and where there are two pairs or more, that mean's 95 % interval by Student's t over the pairs (the
pairs' spread, so that the drift of a machine between rounds does not count as the builds' difference).
Then, where the runs hold two figures or more, the same for each figure alone ("by figure"), so that a
difference carried by one figure shows as that figure's. Last under each build, where the runs keep them,
the row's own windows run by run and the host's time to queue a run in each (`bench gdn`'s
`*_b2b_windows_ms` and `*_b2b_host_windows_ms`), so that the summary alone holds what every run measured.
"""
import argparse
import json
import math
import signal
import statistics

# The default path's back-to-back figures a row may hold, in the order the bench prints them.
KEYS = {
    "fwd_bwd": ["fwd_bwd_b2b_ms", "fwd_bwd_direct_in_scan_b2b_ms", "fwd_bwd_scan_head_b2b_ms",
                "fwd_bwd_scan_wgmma_b2b_ms", "fwd_bwd_u_in_scan_b2b_ms", "fwd_bwd_qk_in_scan_b2b_ms",
                "fwd_bwd_backward_block_a_chunk_b2b_ms"],
    "fwd": ["fwd_b2b_ms", "fwd_output_in_scan_b2b_ms", "fwd_scan_head_b2b_ms", "fwd_scan_wgmma_b2b_ms",
            "fwd_u_in_scan_b2b_ms", "fwd_qk_in_scan_b2b_ms"],
}


# Student's t at 97.5 % (a two-sided 95 % interval) for 1 .. 30 degrees of freedom; the normal's 1.96 past.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def half_width(d):
    """Half the 95 % interval of the mean of the differences d (Student's t over them), or None for one."""
    n = len(d)
    if n < 2:
        return None
    return (T975[n - 2] if n - 1 <= len(T975) else 1.96) * statistics.stdev(d) / math.sqrt(n)


def paired(base_runs, runs):
    """The line on a build's runs paired in order with the base's: each pair's difference of means (us)."""
    if len(runs) != len(base_runs):
        return f"    by run: not paired ({len(runs)} runs against the base's {len(base_runs)})"
    d = [1e3 * (statistics.fmean(b) - statistics.fmean(a)) for a, b in zip(base_runs, runs)]
    n, m, half = len(d), statistics.fmean(d), half_width(d)
    line = f"    by run: {', '.join(f'{x:+.1f}' for x in d)} us; mean {m:+.1f} us"
    if half is not None:
        line += f", 95 % interval [{m - half:+.1f}, {m + half:+.1f}] us ({n} pairs)"
    return line


def by_figure(base_rows, rows, shape, keys):
    """Lines on each figure (key) alone, its runs paired in order with the base's: the mean difference (us) and
    its 95 % interval. A change may move the figures unequally: the default side of an alternation follows the
    other path's runs, which the row's own figure does not (docs/BENCHMARKS.md v84). Nothing where the runs
    differ in number or a figure is not in every run of both."""
    if len(rows) != len(base_rows):
        return []
    lines = []
    width = max(len(k) for k in keys)
    for k in keys:
        if not all(k in r[shape] for r in base_rows + rows):
            continue
        d = [1e3 * (b[shape][k] - a[shape][k]) for a, b in zip(base_rows, rows)]
        m, half = statistics.fmean(d), half_width(d)
        line = f"      {k:<{width}}  {m:+.1f} us"
        if half is not None:
            line += f", [{m - half:+.1f}, {m + half:+.1f}]"
        lines.append(line)
    return ["    by figure, paired by run:"] + lines if len(lines) > 1 else []


def windows(runs, shape, key):
    """The line on the row's own back-to-back windows, run by run ("|" between runs), and where the runs hold
    them, the host's time to queue a run in each window: so that a slow figure shows as one window's or every
    window's, and a host that paces the runs shows as host figures near their windows. Nothing where a run
    lacks the windows (a bench from before they were kept)."""
    def runs_of(k):
        if not all(isinstance(r[shape].get(k), list) and r[shape][k] for r in runs):
            return None
        return " | ".join(" ".join(f"{x:.3f}" for x in r[shape][k]) for r in runs)
    w = runs_of(f"{key}_b2b_windows_ms")
    if w is None:
        return []
    host = runs_of(f"{key}_b2b_host_windows_ms")
    return [f"    windows by run: {w}" + (f"; host a run: {host}" if host is not None else "")]


def bench_json(path):
    """The JSON object of a `bench gdn --json` run's output in path: its first line starting with '{' (the
    bench's table and other lines are skipped). ValueError where there is none; OSError where path cannot be
    read; json.JSONDecodeError (a ValueError) where the line does not parse."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
    raise ValueError(f"no JSON line in {path} (was the bench run with --json?)")


def rows_of(path):
    """The rows (one per shape) of the bench's JSON line in path, keyed by (B, T)."""
    try:
        out = bench_json(path)
    except ValueError as e:
        raise SystemExit(f"ab_summary: {e}")
    return {(r["B"], r["T"]): r for r in out.get("rows", [])}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="+", help="NAME=RUN.json[,RUN.json...], the first the base")
    p.add_argument("--key", choices=sorted(KEYS), default="fwd_bwd")
    a = p.parse_args()
    builds = []
    for spec in a.builds:
        name, sep, files = spec.partition("=")
        if not sep or not files:
            raise SystemExit(f"ab_summary: '{spec}' is not NAME=RUN.json[,RUN.json...]")
        builds.append((name, [rows_of(f) for f in files.split(",")]))
    shapes = None
    for _, runs in builds:
        for rows in runs:
            shapes = set(rows) if shapes is None else shapes & set(rows)
    if not shapes:
        raise SystemExit("ab_summary: the runs share no shape")
    width = max(len(name) for name, _ in builds)
    for shape in sorted(shapes, key=lambda s: (s[1], s[0])):
        print(f"{shape[0]} x {shape[1]}, {'forward + backward' if a.key == 'fwd_bwd' else 'forward'}, back to back (ms):")
        base_runs = None
        base_rows = builds[0][1]
        for name, runs in builds:
            by_run = [[r[shape][k] for k in KEYS[a.key] if k in r[shape]] for r in runs]
            if any(not f for f in by_run):  # a run without the row's own figure: not the bench's keys
                raise SystemExit(f"ab_summary: {name}'s runs lack {KEYS[a.key][0]} at {shape[0]} x {shape[1]}")
            figures = [x for f in by_run for x in f]
            mean = statistics.fmean(figures)
            line = f"  {name:<{width}}  mean {mean:.3f}  [{', '.join(f'{x:.3f}' for x in figures)}]"
            if base_runs is None:
                base_runs, base_mean, base_figures = by_run, mean, figures
            else:
                d = mean - base_mean
                line += f"  {d * 1e3:+.1f} us ({100 * d / base_mean:+.1f} %)"
                if max(figures) < min(base_figures):
                    line += ", all below"
                elif min(figures) > max(base_figures):
                    line += ", all above"
                line += "\n" + paired(base_runs, by_run)
                line += "".join("\n" + x for x in by_figure(base_rows, runs, shape, KEYS[a.key]))
            line += "".join("\n" + x for x in windows(runs, shape, a.key))
            print(line)


if __name__ == "__main__":
    # Read through `head` and the like: a closed pipe ends the script quietly, as it does other tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
