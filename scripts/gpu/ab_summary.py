#!/usr/bin/env python3
"""Two or more builds' `hydrahead bench gdn --json` runs side by side (scripts/gpu/ab-bench).

    python3 scripts/gpu/ab_summary.py NAME=RUN.json[,RUN.json...] NAME=... [--key fwd_bwd]

Each RUN.json holds the JSON line of one `bench gdn` run (other lines are skipped). For every shape
the runs share, each build's back-to-back figures of the default path are listed: the row's own
(`fwd_bwd_b2b_ms`) and the default side of each comparison the bench alternated with it (scan a head
a block, products by warpgroup, the direct term in the scan, chunk_backward a block a chunk), then
their mean, and the mean's difference from the first build's. "all below" (or "all above") says that
every one of a build's figures is under (over) every one of the first build's: the runs of the two
builds overlap nowhere. --key fwd takes the forward's figures instead of forward + backward's.
"""
import argparse
import json
import signal
import statistics

# The default path's back-to-back figures a row may hold, in the order the bench prints them.
KEYS = {
    "fwd_bwd": ["fwd_bwd_b2b_ms", "fwd_bwd_direct_in_scan_b2b_ms", "fwd_bwd_scan_head_b2b_ms",
                "fwd_bwd_scan_wgmma_b2b_ms", "fwd_bwd_backward_block_a_chunk_b2b_ms"],
    "fwd": ["fwd_b2b_ms", "fwd_output_in_scan_b2b_ms", "fwd_scan_head_b2b_ms", "fwd_scan_wgmma_b2b_ms"],
}


def rows_of(path):
    """The rows (one per shape) of the bench's JSON line in path, keyed by (B, T)."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                out = json.loads(line)
                return {(r["B"], r["T"]): r for r in out.get("rows", [])}
    raise SystemExit(f"ab_summary: no JSON line in {path} (was the bench run with --json?)")


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
        base = None
        for name, runs in builds:
            figures = [r[shape][k] for r in runs for k in KEYS[a.key] if k in r[shape]]
            if len(figures) < len(runs):  # a run without the row's own figure: not the bench's keys
                raise SystemExit(f"ab_summary: {name}'s runs lack {KEYS[a.key][0]} at {shape[0]} x {shape[1]}")
            mean = statistics.fmean(figures)
            line = f"  {name:<{width}}  mean {mean:.3f}  [{', '.join(f'{x:.3f}' for x in figures)}]"
            if base is None:
                base = (mean, figures)
            else:
                d = mean - base[0]
                line += f"  {d * 1e3:+.1f} us ({100 * d / base[0]:+.1f} %)"
                if max(figures) < min(base[1]):
                    line += ", all below"
                elif min(figures) > max(base[1]):
                    line += ", all above"
            print(line)


if __name__ == "__main__":
    # Read through `head` and the like: a closed pipe ends the script quietly, as it does other tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
