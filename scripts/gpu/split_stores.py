#!/usr/bin/env python3
"""Vector loads and stores the compiler split into narrower ones, by kernel and CUDA source line, from PTX.

    nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -I. -I<torch includes> -ptx kernels/gdn_chunk.cu -o gdn_chunk.ptx
    python3 scripts/gpu/split_stores.py gdn_chunk.ptx [--kernel chunk_factors] [--space global] [--loads] [--fail]

An assignment through a vector type (`*reinterpret_cast<uint4*>(p) = v`, a struct of eight 16-bit values) is
lowered element by element and merged into one vector access again only where the compiler can prove the
address's alignment; where it cannot, a 16-byte store stays four 4-byte ones (or eight 2-byte ones), and in
global memory each writes part of a 32-byte sector (BENCHMARKS.md v54). A split shows in the PTX as accesses
of one kind, address space and base register at consecutive offsets, the later ones inside the first one's
16-byte block: `st.global.u32 [%rd1]`, `[%rd1+4]`, `[%rd1+8]`, `[%rd1+12]` count as three continued pieces.
Each kernel with any is listed with its count and, when the PTX has line information (-lineinfo), the
source lines of its pieces. --fail exits with status 1 when anything is listed.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$.]+)\s*\(")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(st|ld)((?:\.[a-z0-9:]+)*)\s+(.*?)\[(%\w+)(?:\+(-?\d+))?\]")
WIDTH = {"8": 1, "16": 2, "32": 4, "64": 8}
SPACES = ("global", "shared", "local", "const", "param")


def access(line):
    """(op, space, bytes, base register, offset) of a load or store, or None."""
    m = ACCESS.match(line)
    if not m:
        return None
    op, mods, _, base, off = m.groups()
    parts = mods.strip(".").split(".") if mods else []
    space = next((p for p in parts if p.split("::")[0] in SPACES), "generic").split("::")[0]
    vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v[248]", p)), 1)
    bits = next((WIDTH[p[1:]] for p in reversed(parts) if re.fullmatch(r"[bsuf](8|16|32|64)", p)), None)
    if bits is None:
        return None
    return op, space, vec * bits, base, int(off or 0)


def scan(path):
    """{kernel: [(op, space, (file, line))]}: each continued piece of a split access."""
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    files = {m.group(1): m.group(2) for m in map(FILE.match, lines) if m}
    found, kernel, prev, loc = collections.OrderedDict(), None, None, None
    for line in lines:
        m = ENTRY.match(line)
        if m:
            kernel, prev, loc = m.group(1), None, None
            found.setdefault(kernel, [])
            continue
        if kernel is None:
            continue
        m = LOC.match(line)
        if m:
            loc = (os.path.basename(files.get(m.group(1), m.group(1))), int(m.group(2)))
            continue
        a = access(line)
        if a is None:
            continue
        op, space, width, base, off = a
        if (prev is not None and (op, space, base) == prev[:3] and off == prev[4] + prev[3] and width < 16
                and off % 16 != 0):
            found[kernel].append((op, space, loc))
        prev = (op, space, base, width, off)
    return found


def demangled(names):
    """{mangled: readable}: c++filt's names without their parameter lists, else the mangled ones."""
    names = list(names)
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        plain = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        plain = names
    if len(plain) != len(names):
        plain = names
    readable = {}
    for m, d in zip(names, plain):
        d = d.replace("(anonymous namespace)::", "")
        depth, cut = 0, len(d)
        for i, ch in enumerate(d):  # the parameter list: the first '(' outside the template arguments
            depth += ch == "<"
            depth -= ch == ">"
            if ch == "(" and depth == 0:
                cut = i
                break
        readable[m] = d[:cut].removeprefix("void ")
    return readable


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ptx", nargs="+", help="PTX files (nvcc -ptx, with -lineinfo for source lines)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name contains this")
    ap.add_argument("--space", default="global", choices=("global", "shared", "local", "generic", "all"))
    ap.add_argument("--loads", action="store_true", help="loads too (default: stores only)")
    ap.add_argument("--fail", action="store_true", help="exit with status 1 when any split access is listed")
    args = ap.parse_args()
    listed = 0
    for path in args.ptx:
        if not os.path.exists(path):
            sys.exit(f"{path}: no such file")
        kernels = scan(path)
        names = demangled(kernels)
        for kernel, pieces in kernels.items():
            if args.kernel not in kernel:
                continue
            keep = [p for p in pieces if (args.loads or p[0] == "st") and (args.space == "all" or p[1] == args.space)]
            if not keep:
                continue
            listed += 1
            print(f"{os.path.basename(path)}: {names[kernel]}: {len(keep)} continued pieces")
            by_line = collections.Counter((op, space, loc) for op, space, loc in keep)
            for (op, space, loc), n in sorted(by_line.items(), key=lambda x: (-x[1], str(x[0]))):
                where = f"{loc[0]}:{loc[1]}" if loc else "(no line information)"
                print(f"  {n:5d}  {op}.{space:8} {where}")
    if listed == 0:
        print("no split accesses")
    sys.exit(1 if args.fail and listed else 0)


if __name__ == "__main__":
    main()
