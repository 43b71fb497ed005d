#!/usr/bin/env python3
"""Where a kernel's cycles go, a line each, from Nsight Compute's raw metrics.

    ncu --kernel-name regex:NAME --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy -o report COMMAND ...
    ncu -i report.ncu-rep --page raw > raw.txt
    python3 scripts/gpu/ncu_shares.py LABEL=raw.txt [LABEL=raw.txt ...] [--stalls 4]

Each file holds one profiled launch (--launch-count 1). Prints a Markdown table, a row a file in the
order given: the kernel's duration, its registers a thread, the warps active as a share of the SM's
warp slots, DRAM's throughput as a share of its peak over the kernel's time ('-' where the file lacks
it), the share of cycles the tensor pipe was busy, the tensor instructions issued as a share of
their peak (mma.sync, then wgmma: '-' where the device has none), and the stall reasons with the most
cycles a warp waits between two of its issued instructions (the `..._per_issue_active` ratios;
`selected` and `not_selected`, a warp that was ready, are left out). scripts/gpu/layer-profile prints
this table for the kernels it profiles. Exit 1 names the file and the metric it lacks, or a file with
more than one launch in it; exit 2 on bad arguments.
"""
import argparse
import re
import signal
import sys

METRIC = re.compile(r"^\s*([a-z][A-Za-z0-9_]*__[A-Za-z0-9_.]+)\s+(?:(\S+)\s+)?(\S+)\s*$")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
SECONDS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3,
           "second": 1e3}
NOT_WAITS = {"selected", "not_selected"}
# DRAM's throughput in SpeedOfLight, by the names Nsight Compute's versions give it.
DRAM = ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram__throughput.avg.pct_of_peak_sustained_elapsed")


class Missing(Exception):
    pass


def read_metrics(path):
    """{name: (unit, value)} of the file's metric lines; a name twice means two launches."""
    out = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = METRIC.match(line)
            if not m:
                continue
            name, unit, text = m.group(1), m.group(2) or "", m.group(3).replace(",", "")
            try:  # not ncu_top.number, which reads n/a as 0: a metric ncu could not give is left out here
                value = float(text)
            except ValueError:
                continue
            if name in out:
                raise Missing(f"{path}: {name} appears twice: the file holds more than one launch "
                              "(profile with --launch-count 1)")
            out[name] = (unit, value)
    return out


def need(metrics, path, *names):
    for name in names:
        if name in metrics:
            return metrics[name]
    raise Missing(f"{path}: no {names[0]} (profile with --section SpeedOfLight --section "
                  "ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy)")


def row(label, path, stalls):
    m = read_metrics(path)
    unit, t = need(m, path, "gpu__time_duration.sum")
    if unit not in SECONDS:
        raise Missing(f"{path}: gpu__time_duration.sum in '{unit}', not a unit of time")
    ms = t * SECONDS[unit]
    regs = need(m, path, "launch__registers_per_thread")[1]
    warps = need(m, path, "sm__warps_active.avg.pct_of_peak_sustained_active")[1]
    dram = next((m[n][1] for n in DRAM if n in m), None)
    pipe = need(m, path, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")[1]
    hmma = need(m, path, "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active")[1]
    gmma = m.get("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active")
    waits = []
    for name, (_, value) in m.items():
        s = STALL.match(name)
        if s and s.group(1) not in NOT_WAITS:
            waits.append((value, s.group(1).replace("_", " ")))
    if not waits:
        raise Missing(f"{path}: no smsp__average_warps_issue_stalled_*_per_issue_active.ratio "
                      "(profile with --section WarpStateStats)")
    waits.sort(key=lambda w: -w[0])
    top = ", ".join(f"{name} {value:.2f}" for value, name in waits[:stalls])
    gmma_text = "-" if gmma is None else f"{gmma[1]:.1f} %"
    dram_text = "-" if dram is None else f"{dram:.1f} %"
    return (f"| {label} | {ms:.3f} ms | {regs:.0f} | {warps:.1f} % | {dram_text} | {pipe:.1f} % | {hmma:.1f} % / "
            f"{gmma_text} | {top} |")


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", metavar="LABEL=FILE", help="a label and a raw-page file")
    p.add_argument("--stalls", type=int, default=4, help="stall reasons a row (default 4)")
    a = p.parse_args()
    if a.stalls < 1:
        p.error("--stalls takes a count of at least 1")
    pairs = []
    for r in a.reports:
        label, sep, path = r.partition("=")
        if not sep or not label or not path:
            p.error(f"'{r}' is not LABEL=FILE")
        pairs.append((label, path))
    rows = []
    try:
        for label, path in pairs:
            rows.append(row(label, path, a.stalls))
    except (Missing, OSError) as e:
        print(f"ncu_shares: {e}", file=sys.stderr)
        return 1
    print("| kernel | duration | registers | warps active | DRAM (of peak) | tensor pipe active | mma.sync / wgmma "
          "issued (of peak) | stalls a warp between issues (cycles), the largest |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
