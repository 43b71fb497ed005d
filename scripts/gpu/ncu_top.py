#!/usr/bin/env python3
"""The SASS instructions a kernel's warps were sampled on most, from Nsight Compute's source page.

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/gpu/ncu_top.py source.csv [--top 40]

For each kernel in the file (one CSV table each): the total of the warp-state samples, those samples
summed by stall reason (the columns that count one reason), then the instructions with the most samples,
each with its share, its address and its text. With --mix (a SASS table), also the executed warp
instructions summed by opcode (the mnemonic without its modifiers), the mix that sets an issue-bound
kernel's time.
"""
import argparse
import csv
import io
import re
import signal


def tables(text):
    """The file's CSV tables, each with the line before its header (ncu names the kernel there). A
    second copy of the header starts a new table, whether or not other lines come between."""
    out, title, block = [], "", []
    for line in text.splitlines():
        if line.startswith('"') and ("Source" in line or "Address" in line) and (not block or line == block[0]):
            if block:
                out.append((title, block))
            block = [line]
        elif block and line.startswith('"'):
            block.append(line)
        else:
            if block:
                out.append((title, block))
                block = []
            if line.strip():
                title = line.strip()
    if block:
        out.append((title, block))
    return out


def opcode(text):
    """An instruction's mnemonic without its predicate guard and modifiers: '@P0 FFMA.FTZ R1, ...' -> 'FFMA'."""
    words = [w for w in text.strip().lstrip("{").split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def number(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--mix", action="store_true", help="executed instructions by opcode")
    args = ap.parse_args()
    with open(args.csv, errors="replace") as f:
        text = f.read()
    found = tables(text)
    if not found:
        print(f"{args.csv}: no source table found; its first lines:")
        print("\n".join(text.splitlines()[:10]))
        return
    for title, block in found:
        rows = list(csv.DictReader(io.StringIO("\n".join(block))))
        if not rows:
            continue
        cols = list(rows[0].keys())
        src = next((c for c in cols if c.strip() == "Source"), None)
        addr = next((c for c in cols if c.strip() == "Address"), None)
        allc = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
        if src is None or allc is None:
            print(f"{title}: columns {cols[:12]} ... (no Source or warp-stall samples)")
            continue
        reasons = [c for c in cols if re.match(r"\s*stall_", c) or (c.startswith("Stall") and c != allc)]
        total = sum(number(r[allc]) for r in rows)
        print(f"== {title[:140]}")
        print(f"{len(rows)} instructions, {total:.0f} warp-state samples")
        sums = sorted(((sum(number(r[c]) for r in rows), c) for c in reasons), reverse=True)
        for s, c in sums[:12]:
            if s > 0:
                print(f"  {100 * s / max(total, 1):5.1f}%  {c.strip()}")
        execc = next((c for c in cols if c.strip() == "Instructions Executed"), None)
        if args.mix and execc is not None:
            mix = {}
            for r in rows:
                op = opcode(r[src])
                mix[op] = mix.get(op, 0.0) + number(r[execc])
            executed = sum(mix.values())
            print(f"{executed:.0f} warp instructions executed; by opcode:")
            for op, n in sorted(mix.items(), key=lambda x: -x[1])[:30]:
                print(f"  {100 * n / max(executed, 1):5.1f}%  {n:14.0f}  {op}")
        ranked = sorted(range(len(rows)), key=lambda i: -number(rows[i][allc]))
        print(f"{'share':>6} {'address':>8}  instruction")
        for i in ranked[: args.top]:
            r = rows[i]
            share = 100 * number(r[allc]) / max(total, 1)
            top_reason = max(reasons, key=lambda c: number(r[c])) if reasons else ""
            print(f"{share:5.1f}% {r.get(addr, '')[-8:]:>8}  {r[src].strip()[:70]:70}  {top_reason.strip()[:28]}")


if __name__ == "__main__":
    # Read through `head` and the like: a closed pipe ends the script quietly, as it does other tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
