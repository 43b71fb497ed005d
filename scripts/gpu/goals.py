#!/usr/bin/env python3
"""The LA heads' kernel goals, from one `hydrahead bench gdn --json` run (scripts/gpu/goals).

    python3 scripts/gpu/goals.py RUN.json [--card NAME]

RUN.json holds the bench's output; its JSON line (the one starting with '{') is read, the other lines
skipped. Three goals, each against its target, back to back:
  - the forward at B1 T32K (the row's fwd_b2b_ms) at most 0.45 ms;
  - forward + backward at B1 T32K (fwd_bwd_b2b_ms) at most 1.4 ms;
  - the hybrid layer at 7:1 against dense attention at B1 T128K (the layer's speedup_sustained, over two
    seconds a side; speedup_b2b beside it) at least 5x.
The goals are set at H16 Dk = Dv = 128, bfloat16 inputs, on CUDA: a run at another setting (the JSON's
device, dtype, heads, dim) is refused. The layer's ratio is not in the JSON: the run is trusted to have
used --ratio 7. A goal whose figure the run lacks (no such row or layer, or the bench run without the
layer) reads "not measured". Exit 0 with the table; 2 when the file cannot be read, has no JSON line, or
the run's setting is not the goals'.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_summary import bench_json  # noqa: E402  the bench's JSON line

FWD, FWD_BWD, LAYER = 0.45, 1.4, 5.0


def refuse(message):
    print(f"goals: {message}", file=sys.stderr)
    sys.exit(2)


def load(path):
    try:
        return bench_json(path)
    except OSError as e:
        refuse(f"cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        refuse(f"{path}: the JSON line does not parse: {e}")
    except ValueError as e:
        refuse(str(e))


def find(items, B, T):
    for x in items or []:
        if x.get("B") == B and x.get("T") == T:
            return x
    return None


def at_most(value, target):
    if value is None:
        return "not measured"
    if value <= target:
        return f"met ({target - value:.3f} ms under)"
    return f"not met ({value - target:.3f} ms over, {value / target:.2f}x the target)"


def at_least(value, target):
    if value is None:
        return "not measured"
    if value >= target:
        return f"met ({value - target:.2f}x over)"
    return f"not met ({target - value:.2f}x short)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="the output of `hydrahead bench gdn --json` (other lines are skipped)")
    p.add_argument("--card", default="", help="the device's name, printed in the header")
    a = p.parse_args()
    out = load(a.run)
    setting = {k: out.get(k) for k in ("device", "dtype", "heads", "dim")}
    on_cuda = str(setting["device"]).split(":")[0] == "cuda"
    if not on_cuda or (setting["dtype"], setting["heads"], setting["dim"]) != ("bf16", 16, 128):
        shown = ", ".join(f"{k} {v}" for k, v in setting.items())
        refuse(f"{a.run} was run at {shown}; the goals are set at device cuda, dtype bf16, heads 16, dim 128")
    row = find(out.get("rows"), 1, 32768)
    layer = find(out.get("layer"), 1, 131072)
    fwd = row.get("fwd_b2b_ms") if row else None
    fb = row.get("fwd_bwd_b2b_ms") if row else None
    sus = layer.get("speedup_sustained") if layer else None
    b2b = layer.get("speedup_b2b") if layer else None

    def ms(x):
        return "-" if x is None else f"{x:.3f} ms"

    def times(x):
        return "-" if x is None else f"{x:.2f}x"

    print(f"The kernel goals{' on ' + a.card if a.card else ''} (back to back):")
    print("| goal | target | measured | |")
    print("|---|---|---|---|")
    print(f"| forward, B1 T32K | <= {FWD} ms | {ms(fwd)} | {at_most(fwd, FWD)} |")
    print(f"| forward + backward, B1 T32K | <= {FWD_BWD} ms | {ms(fb)} | {at_most(fb, FWD_BWD)} |")
    extra = f" ({times(b2b)} back to back)" if b2b is not None else ""
    print(f"| hybrid layer 7:1 against dense, B1 T128K, sustained | >= {LAYER:g}x | {times(sus)}{extra} | {at_least(sus, LAYER)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
