#!/usr/bin/env python3
"""Run a command while nvidia-smi samples the GPU's clocks, power and slowdown reasons; then summarise.

  python3 scripts/gpu/smi_log.py [--interval-ms 100] [--csv FILE] -- COMMAND [ARGS...]

The command's output passes through. The summary (on stderr) gives, over the samples taken while some
SM clock was above idle, the SM clock (median, 10th percentile, lowest), the power draw against the
power limit, the temperature, and how often each slowdown reason was active. It tells whether a
timing ran on a device held back by its power or thermal limits. Exits with the command's status.
"""
import argparse
import csv
import shutil
import statistics
import subprocess
import sys
import tempfile

FIELDS = ["timestamp", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu"]
# Slowdown reasons, under the names nvidia-smi has used for them (newer drivers say "event").
REASONS = ["sw_power_cap", "hw_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown"]


def query_fields():
    for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):
        fields = FIELDS + [f"{prefix}.{r}" for r in REASONS]
        probe = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return fields
    return FIELDS


def number(text):
    try:
        return float(text)
    except ValueError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval-ms", type=int, default=100)
    ap.add_argument("--csv", help="also keep the raw samples here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given")
    if shutil.which("nvidia-smi") is None:
        print("smi_log: no nvidia-smi here; running the command without samples", file=sys.stderr)
        return subprocess.call(cmd)
    fields = query_fields()
    # The samples go to a file, not a pipe: nobody reads a pipe while the command runs, and once its 64 KB
    # filled (about 550 samples) nvidia-smi stopped sampling until the end.
    with tempfile.TemporaryFile(mode="w+") as samples:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits",
                                f"-lms={a.interval_ms}"], stdout=samples, text=True)
        try:
            rc = subprocess.call(cmd)
        finally:
            smi.terminate()
            smi.wait()
        samples.seek(0)
        out = samples.read()
    rows = [r for r in csv.reader(out.splitlines()) if len(r) == len(fields)]
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(fields)
            w.writerows(rows)
    col = {name: i for i, name in enumerate(fields)}
    busy = [r for r in rows if (number(r[col["clocks.sm"]].strip()) or 0) > 500]
    if not busy:
        print(f"smi_log: {len(rows)} samples, none with the SM clock above 500 MHz", file=sys.stderr)
        return rc
    values = lambda name: sorted(v for v in (number(r[col[name]].strip()) for r in busy) if v is not None)
    clk, power, temp = values("clocks.sm"), values("power.draw"), values("temperature.gpu")
    top = values("clocks.max.sm")
    limit = values("power.limit")
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]
    print(f"smi_log: {len(busy)} busy samples of {len(rows)} ({a.interval_ms} ms apart)", file=sys.stderr)
    print(f"  SM clock MHz: median {statistics.median(clk):.0f}, 10th percentile {pct(clk, 0.1):.0f}, lowest "
          f"{clk[0]:.0f}, highest {clk[-1]:.0f}" + (f" (the device's most {top[-1]:.0f})" if top else ""), file=sys.stderr)
    if power:
        print(f"  power W: median {statistics.median(power):.0f}, 90th percentile {pct(power, 0.9):.0f}, highest "
              f"{power[-1]:.0f}" + (f" (limit {limit[-1]:.0f})" if limit else ""), file=sys.stderr)
    if temp:
        print(f"  temperature C: median {statistics.median(temp):.0f}, highest {temp[-1]:.0f}", file=sys.stderr)
    for name in fields[len(FIELDS):]:
        active = sum(1 for r in busy if r[col[name]].strip().lower() == "active")
        print(f"  {name.split('.', 1)[1]}: active in {100.0 * active / len(busy):.0f} % of busy samples", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
