#!/usr/bin/env python3
"""A kernel's executed instructions and warp-state samples summed by CUDA source line.

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    cuobjdump -xelf all kernels.o && nvdisasm -gi -c file.cubin > kernel.sass
    python3 scripts/gpu/ncu_lines.py source.csv kernel.sass --function 'regex:chunk_factors_kernel<' [--top 40]

Nsight Compute's SASS table (one row an instruction, in address order) carries the counts; nvdisasm's
listing with line information (-gi: each instruction's inlining chain) says which source line each
instruction came from. The two list the same instructions in the same order, so they are joined row
by row; the opcodes are compared as they are joined, and a mismatch stops the script. --function is the
pattern ncu was given (--kernel-name, with or without `regex:`), searched for in each listed kernel's name
as ncu writes it (scripts/gpu/ncu_names.py); of the kernels it names, the one with the table's
instruction count is taken. For each
source line: its executed warp instructions, its share of them, its share of the stall samples and
the line's text (as the file reads now). --show FILE:LINE (a file's base name and a line, innermost
or outermost) lists that line's instructions in address order: index, executed, samples, the stall
reason with the most samples, and the instruction. --metric NAME sums one more of the table's columns
by line (the first whose name contains NAME, ignoring case; for instance "L2 Theoretical Sectors Global
Excessive", the 32-byte sectors a line's global accesses touch beyond the fewest its bytes need), adds
its share and count to each row, and orders the rows by it. --reason NAME (a stall reason's column, for
instance stall_barrier) lists the instructions with the most samples of that reason: each one's share of
all the kernel's samples, its index, its innermost and outermost source lines and the instruction; which
barrier the warps wait at, for instance, where the lines' sums mix every reason. --show, --metric and
--reason exclude one another.
"""
import argparse
import csv
import io
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_names import ncu_name, ncu_pattern  # noqa: E402
from ncu_top import number, opcode, tables  # noqa: E402

LINE = re.compile(r'"([^"]+)", line (\d+)')
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"^\s*\.text\.(\S+?):?\s*$|\.section\s+\.text\.(\S+?),")


def disasm_functions(path):
    """{mangled name: [(opcode, (file, line), (file, line))]} from an nvdisasm -g or -gi listing: each
    instruction's innermost source line outside the toolkit's headers and its outermost (the kernel's
    own line). -gi writes an instruction's inlining chain as consecutive //## lines, innermost first."""
    funcs, cur, chain, fresh = {}, None, [], True
    with open(path, errors="replace") as f:
        for raw in f:
            m = FUNC.search(raw)
            if m:
                cur = m.group(1) or m.group(2)
                funcs.setdefault(cur, [])
                chain, fresh = [], True
                continue
            if raw.lstrip().startswith("//##"):
                if fresh:  # a new chain: the instructions after it take it
                    chain, fresh = [], False
                chain += [(f, int(n)) for f, n in LINE.findall(raw)]
                continue
            m = INSN.search(raw)
            if m and cur is not None:
                fresh = True
                own = [c for c in chain if not c[0].startswith("/usr/")]
                inner = own[0] if own else (chain[0] if chain else (None, 0))
                outer = chain[-1] if chain else (None, 0)
                funcs[cur].append((opcode(m.group(2)), inner, outer))
    return funcs


def place(at):
    """A (file, line) pair as the tables print it: the file's base name and the line, "?" where unknown."""
    return f"{os.path.basename(at[0])}:{at[1]}" if at[0] else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (one kernel)")
    ap.add_argument("sass", help="nvdisasm -gi listing holding the kernel")
    ap.add_argument("--function", required=True,
                    help="the kernel's name pattern as ncu's --kernel-name took it: a regular expression (`regex:` "
                         "optional) searched for in the name as ncu writes it, such as column_scan_kernel<(int)128, ...>")
    ap.add_argument("--top", type=int, default=40)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--show", metavar="FILE:LINE", help="list the instructions of one source line")
    how.add_argument("--metric", metavar="NAME", help="also sum the first column whose name contains NAME, and sort by it")
    how.add_argument("--reason", metavar="NAME", help="list the instructions with the most samples of one stall reason")
    args = ap.parse_args()
    with open(args.csv, errors="replace") as f:
        found = tables(f.read())
    if not found:
        sys.exit(f"{args.csv}: no source table")
    rows = list(csv.DictReader(io.StringIO("\n".join(found[0][1]))))
    cols = list(rows[0].keys())
    src = next(c for c in cols if c.strip() == "Source")
    execc = next((c for c in cols if c.strip() == "Instructions Executed"), None)
    allc = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    if execc is None or allc is None:
        sys.exit(f"{args.csv}: no 'Instructions Executed' or warp-stall column")
    metc = None
    if args.metric:
        metc = next((c for c in cols if args.metric.lower() in c.lower()), None)
        if metc is None:
            sys.exit(f"{args.csv}: no column named like {args.metric!r}; it has: " + ", ".join(c.strip() for c in cols))
    funcs = disasm_functions(args.sass)
    try:
        function = ncu_pattern(args.function)
    except re.error as e:
        sys.exit(f"--function {args.function!r}: not a regular expression: {e}")
    names = [n for n in funcs if function.search(ncu_name(n))]
    if not names:
        sys.exit(f"{args.sass}: no function matching {args.function!r}; it has {len(funcs)}")
    # The matching function with the same instruction count as the table.
    name = next((n for n in names if len(funcs[n]) == len(rows)), None)
    if name is None:
        sys.exit(f"no function matching {args.function!r} has {len(rows)} instructions: "
                 + ", ".join(f"{ncu_name(n)[:80]} ({len(funcs[n])})" for n in names))
    for i, (r, (op, _, _)) in enumerate(zip(rows, funcs[name])):
        if opcode(r[src]) != op:
            sys.exit(f"instruction {i}: the table has {r[src].strip()!r}, the listing {op}")
    if args.reason:
        col = next((c for c in cols if c.strip() == args.reason), None)
        if col is None:
            sys.exit(f"{args.csv}: no stall reason {args.reason!r}; it has: "
                     + ", ".join(c.strip() for c in cols if c.strip().startswith("stall_")))
        total = sum(number(r[allc]) for r in rows)
        ranked = sorted(((number(r[col]), i, r[src].strip(), at, call)
                         for i, (r, (_, at, call)) in enumerate(zip(rows, funcs[name]))), key=lambda x: (-x[0], x[1]))
        of_reason = sum(x[0] for x in ranked)
        print(f"{args.reason}: {of_reason:.0f} of {total:.0f} samples ({100 * of_reason / max(total, 1):.1f} %)")
        for n, i, ins, at, call in ranked[: args.top]:
            if n <= 0:
                break
            print(f"{100 * n / max(total, 1):6.1f}% {i:6d}  {place(at):22} <- {place(call):22} {ins}")
        return
    if args.show:
        reasons = [c for c in cols if c.strip().startswith("stall_") and "Not Issued" not in c]
        shown = 0
        for i, (r, (op, at, call)) in enumerate(zip(rows, funcs[name])):
            names_of = {place(x) for x in (at, call) if x[0]}
            if args.show not in names_of:
                continue
            top = max(reasons, key=lambda c: number(r[c])).strip() if reasons else ""
            print(f"{i:6d} {number(r[execc]):12.0f} {number(r[allc]):8.0f}  {top:24} {r[src].strip()}")
            shown += 1
        if shown == 0:
            sys.exit(f"no instruction of {name[:60]} comes from {args.show}")
        return
    inner, outer, sources = {}, {}, {}
    for r, (_, at, call) in zip(rows, funcs[name]):
        for table, key in ((inner, at), (outer, call)):
            e, s, m = table.get(key, (0.0, 0.0, 0.0))
            table[key] = (e + number(r[execc]), s + number(r[allc]), m + (number(r[metc]) if metc else 0.0))
    executed = sum(v[0] for v in inner.values())
    samples = sum(v[1] for v in inner.values())
    measured = sum(v[2] for v in inner.values())
    print(f"{name[:120]}: {len(rows)} instructions, {executed:.0f} warp instructions executed, {samples:.0f} samples"
          + (f", {measured:.0f} {metc.strip()}" if metc else ""))

    def text(file, line):
        if file not in sources:
            try:
                with open(file, errors="replace") as f:
                    sources[file] = f.read().splitlines()
            except OSError:
                sources[file] = []
        s = sources[file]
        return s[line - 1].strip() if 0 < line <= len(s) else ""

    for title, table in (("by the line itself", inner), ("by the outermost call (the kernel's own line)", outer)):
        print(f"== {title}")
        extra = f" {'metric %':>8} {'count':>11}" if metc else ""
        print(f"{'exec %':>7} {'stall %':>7}{extra}  source line")
        order = 2 if metc else 0
        for (file, line), (e, s, m) in sorted(table.items(), key=lambda x: -x[1][order])[: args.top]:
            where = place((file, line))
            extra = f" {100 * m / max(measured, 1):7.1f}% {m:11.0f}" if metc else ""
            print(f"{100 * e / max(executed, 1):6.1f}% {100 * s / max(samples, 1):6.1f}%{extra}  {where:22} {text(file, line)[:90]}")


if __name__ == "__main__":
    # Read through `head` and the like: a closed pipe ends the script quietly, as it does other tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
