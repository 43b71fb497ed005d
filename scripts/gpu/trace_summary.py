#!/usr/bin/env python3
"""Sums GPU kernel time by kernel name in a Chrome trace (e.g. `hydrahead bench analyze --profile`).

    python3 scripts/gpu/trace_summary.py trace.json [--top 25] [--by-scope hh::] [--ops] [--streams]

With --by-scope PREFIX, each kernel's time is charged to the innermost profiler range named PREFIX...
that was open on the launching thread when it was launched (core/attention/gdn.cpp names the stages
of the gated delta rule hh::gdn::...), and each range's kernels are listed by name under it.
With --ops, each kernel is charged to the chain of operators (outermost two, then the innermost) open
on the launching thread at its launch: where a copy or an elementwise kernel comes from.
With --streams, the kernels in the order they ran, with their stream, start, length and the part of
their time some kernel on another stream ran too; then each stream's busy time and the time the
device ran no kernel at all.
"""
import argparse
import collections
import json
import signal


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by-scope", metavar="PREFIX", help="charge kernels to the innermost range named PREFIX...")
    ap.add_argument("--ops", action="store_true", help="charge kernels to the operators that launched them")
    ap.add_argument("--streams", action="store_true", help="the kernels in order, by stream, with their overlap")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    if args.by_scope:
        return by_scope(events, args.by_scope, args.top)
    if args.ops:
        return by_ops(events, args.top)
    if args.streams:
        return streams(events)
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
    host(events, first, last)


def host(events, first, last):
    """The host's side: where the traced region's first operator starts against the first kernel, and
    the CUDA runtime and driver calls by total time (a long one the device waits behind shows here)."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    calls = collections.Counter()
    ncalls = collections.Counter()
    longest = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            calls[e["name"]] += e["dur"]
            ncalls[e["name"]] += 1
            longest[e["name"]] = max(longest[e["name"]], e["dur"])
    if not ops or first is None:
        return
    start = min(e["ts"] for e in ops)
    end = max(e["ts"] + e["dur"] for e in ops)
    print(f"host: operators from 0 to {(end - start) / 1e3:.2f} ms; kernels from {(first - start) / 1e3:.2f} "
          f"to {(last - start) / 1e3:.2f} ms")
    for name, us in calls.most_common(8):
        print(f"{us / 1e3:9.2f} ms {ncalls[name]:7d}x  longest {longest[name] / 1e3:.2f} ms  {name[:80]}")


def kernels_of(events):
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])


def open_ranges(events, keep=lambda name: True):
    """For each kernel, the profiler ranges (operators, annotations) whose name passes `keep` that were
    open on the launching thread when it was launched, outermost first: a function of the kernel event."""
    ranges = collections.defaultdict(list)
    launches = {}
    for e in events:
        cat = e.get("cat", "")
        if cat in ("cpu_op", "user_annotation") and "dur" in e and keep(e.get("name", "")):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["tid"], e["ts"])

    def around(kernel):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return []
        tid, ts = launch
        return sorted((r for r in ranges.get(tid, ()) if r[0] <= ts <= r[1]), key=lambda r: (r[0], -r[1]))

    return around


def by_scope(events, prefix, top):
    # Each kernel charged to its innermost enclosing range named prefix...
    around = open_ranges(events, lambda name: name.startswith(prefix))
    scope_total = collections.Counter()
    per_scope = collections.defaultdict(collections.Counter)
    for e in kernels_of(events):
        inside = around(e)
        where = min(inside, key=lambda r: r[1] - r[0])[2] if inside else "(outside " + prefix + "*)"
        scope_total[where] += e["dur"]
        per_scope[where][e["name"]] += e["dur"]
    busy = sum(scope_total.values())
    print(f"kernel time {busy / 1e3:.1f} ms by innermost {prefix}* range")
    for where, us in scope_total.most_common():
        print(f"{us / 1e3:9.2f} ms {100 * us / max(busy, 1):5.1f}%  {where}")
        for name, k in per_scope[where].most_common(min(top, 6)):
            print(f"    {k / 1e3:9.2f} ms  {name[:100]}")


def by_ops(events, top):
    # Each kernel charged to the chain of operators open at its launch (outermost two, then the innermost).
    around = open_ranges(events)
    total = collections.Counter()
    count = collections.Counter()
    for e in kernels_of(events):
        names = [r[2] for r in around(e)]
        chain = " > ".join(names[:2] + (["..."] if len(names) > 3 else []) + names[2:][-1:]) if names else "(no operator)"
        key = (chain, e["name"])
        total[key] += e["dur"]
        count[key] += 1
    busy = sum(total.values())
    print(f"kernel time {busy / 1e3:.1f} ms by launching operators")
    for (chain, name), us in total.most_common(top):
        print(f"{us / 1e3:9.2f} ms {count[(chain, name)]:5d}x  {chain[:120]}\n{'':23}{name[:100]}")


def covered(spans):
    """The length of the union of (lo, hi) intervals."""
    total, reach = 0.0, None
    for lo, hi in sorted(spans):
        lo = lo if reach is None else max(lo, reach)
        if hi > lo:
            total += hi - lo
        reach = hi if reach is None else max(reach, hi)
    return total


def streams(events):
    ks = kernels_of(events)
    if not ks:
        return
    t0 = ks[0]["ts"]
    stream_of = lambda e: e.get("args", {}).get("stream", "?")
    print(f"{'start ms':>9} {'ms':>7} {'beside':>7} stream  kernel  (beside: time another stream's kernel also ran)")
    for e in ks:
        a, b = e["ts"], e["ts"] + e["dur"]
        beside = covered((max(a, o["ts"]), min(b, o["ts"] + o["dur"])) for o in ks
                         if stream_of(o) != stream_of(e) and o["ts"] < b and o["ts"] + o["dur"] > a)
        print(f"{(a - t0) / 1e3:9.3f} {e['dur'] / 1e3:7.3f} {beside / 1e3:7.3f} {str(stream_of(e)):>6}  {e['name'][:90]}")
    busy = collections.Counter()
    for e in ks:
        busy[stream_of(e)] += e["dur"]
    end = max(e["ts"] + e["dur"] for e in ks)
    idle = (end - t0) - covered((e["ts"], e["ts"] + e["dur"]) for e in ks)
    print(f"span {(end - t0) / 1e3:.2f} ms, no kernel running {idle / 1e3:.2f} ms; busy by stream: " +
          ", ".join(f"{s} {us / 1e3:.2f} ms" for s, us in busy.most_common()))


if __name__ == "__main__":
    # Read through `head` and the like: a closed pipe ends the script quietly, as it does other tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
