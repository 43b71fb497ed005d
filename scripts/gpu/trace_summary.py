#!/usr/bin/env python3
"""Sums GPU kernel time by kernel name in a Chrome trace (e.g. `hydrahead bench analyze --profile`).

    python3 scripts/gpu/trace_summary.py trace.json [--top 25]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    total = collections.Counter()
    count = collections.Counter()
    first, last = None, None
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        name = e["name"]
        total[name] += e["dur"]
        count[name] += 1
        first = e["ts"] if first is None else min(first, e["ts"])
        last = e["ts"] + e["dur"] if last is None else max(last, e["ts"] + e["dur"])
    busy = sum(total.values())
    span = (last - first) if first is not None else 0
    print(f"kernels: {sum(count.values())}, busy {busy / 1e3:.1f} ms over a span of {span / 1e3:.1f} ms")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:9.2f} ms {100 * us / max(busy, 1):5.1f}% {count[name]:7d}x  {name[:110]}")


if __name__ == "__main__":
    main()
