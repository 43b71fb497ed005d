#!/usr/bin/env python3
"""Two builds of a CUDA file's kernels compared by their machine instructions, opcode by opcode.

    cuobjdump -sass old.cubin > old.sass; cuobjdump -sass new.cubin > new.sass   (nvcc -cubin, as for
    scripts/gpu/same_machine_code.py)
    python3 scripts/gpu/sass_ops.py old.sass new.sass [--kernel REGEX] [--modifiers] [--top 20]

Where same_machine_code.py says two kernels differ, this says how: for each kernel of both listings whose
name matches REGEX (a search in the mangled name, as cuobjdump prints it after "Function :"), the number of
instructions on each side and the opcodes whose counts differ, largest difference first (`LDG`, `HMMA`,
`BAR`, ...; with --modifiers the whole mnemonic, `LDG.E.128.CONSTANT`). A change of a few lines that costs
far more time than its instructions shows up here as scheduling: barriers, loads or branches the compiler
added or moved elsewhere in the kernel. A .cubin argument is read through `cuobjdump -sass` where that tool
is on the PATH. The kernels of an anonymous namespace are matched across the two builds as
same_machine_code.py matches them; a kernel whose parameters' types changed (a float pointer become a struct)
is matched by its demangled name without the parameter list (c++filt, where it is on the PATH) and printed as
OLD -> NEW. Exit status 0 when every compared kernel has the same counts, 1 when any
differ or a matching kernel is on one side only, 2 on unreadable input or no kernel matching.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from same_machine_code import ANON  # noqa: E402

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# /*0a30*/   @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;   (the encoding's own /* 0x... */ lines carry no address)
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def listing(path):
    """The text of a cuobjdump -sass listing: the file itself, or cuobjdump's output for a cubin."""
    if path.endswith(".cubin"):
        tool = shutil.which("cuobjdump")
        if tool is None:
            raise ValueError(f"{path}: a cubin needs cuobjdump on the PATH (or give its `cuobjdump -sass` output)")
        return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def kernels(text, modifiers, mangled=None):
    """{normalised kernel name: Counter of its opcodes} of a cuobjdump -sass listing; mangled, a dict, gets
    {normalised name: the name as the listing has it}."""
    out, current = {}, None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = ANON.sub("_GLOBAL__N_", m.group(1))
            current = out.setdefault(name, collections.Counter())
            if mangled is not None:
                mangled[name] = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            op = m.group(1)
            current[op if modifiers else op.split(".")[0]] += 1
    return out


def without_parameters(names):
    """{mangled name: its demangled name up to its parameter list} by c++filt; {} without c++filt, or for a
    name c++filt leaves as it is."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {}
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True).stdout.splitlines()
    keys = {}
    for name, plain in zip(names, out):
        if plain == name or not plain.endswith(")"):
            continue
        depth = 0
        for i in range(len(plain) - 1, -1, -1):  # the '(' that opens the last, outermost group
            depth += {")": 1, "(": -1}.get(plain[i], 0)
            if depth == 0:
                keys[name] = plain[:i]
                break
    return keys


def pair_renamed(old_only, new_only, mangled_old, mangled_new):
    """[(old name, new name)]: kernels on one side each whose names differ in their parameters only, where
    that name without its parameters is one kernel's on each side."""
    keys = without_parameters([mangled_old[n] for n in old_only] + [mangled_new[n] for n in new_only])
    by_key = collections.defaultdict(lambda: ([], []))
    for side, names, mangled in ((0, old_only, mangled_old), (1, new_only, mangled_new)):
        for n in names:
            if mangled[n] in keys:
                by_key[keys[mangled[n]]][side].append(n)
    return sorted((o[0], n[0]) for o, n in by_key.values() if len(o) == 1 and len(n) == 1)


def compare(label, o, n, top):
    """Prints one kernel's counts on both sides; True when they differ."""
    to, tn = sum(o.values()), sum(n.values())
    diffs = sorted(((n[k] - o[k], k) for k in set(o) | set(n) if n[k] != o[k]), key=lambda d: (-abs(d[0]), d[1]))
    if not diffs:
        print(f"{label}: the same counts, {to} instructions")
        return False
    print(f"{label}: {to} -> {tn} instructions ({tn - to:+d})")
    for d, k in diffs[:top]:
        print(f"    {k:<24} {o[k]:>6} -> {n[k]:<6} {d:+d}")
    if len(diffs) > top:
        print(f"    ... and {len(diffs) - top} more")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="cuobjdump -sass output (or a .cubin) of the first build")
    ap.add_argument("new", help="the same of the second build")
    ap.add_argument("--kernel", default="", help="compare only the kernels whose mangled name this matches (re.search)")
    ap.add_argument("--modifiers", action="store_true", help="count whole mnemonics (LDG.E.128), not opcodes (LDG)")
    ap.add_argument("--top", type=int, default=20, help="opcodes listed a kernel, largest difference first")
    a = ap.parse_args()
    try:
        pattern = re.compile(a.kernel)
        mangled_old, mangled_new = {}, {}
        old = kernels(listing(a.old), a.modifiers, mangled_old)
        new = kernels(listing(a.new), a.modifiers, mangled_new)
    except (OSError, ValueError, re.error, subprocess.CalledProcessError) as e:
        print(f"sass_ops: {e}", file=sys.stderr)
        return 2
    for side, ks in ((a.old, old), (a.new, new)):
        if not ks:
            print(f"sass_ops: {side}: no kernel (no 'Function :' line): not a cuobjdump -sass listing?", file=sys.stderr)
            return 2
    names = sorted(n for n in set(old) | set(new) if pattern.search(n))
    if not names:
        print(f"sass_ops: no kernel matches '{a.kernel}'", file=sys.stderr)
        return 2
    old_only = [n for n in names if n not in new]
    new_only = [n for n in names if n not in old]
    pairs = pair_renamed(old_only, new_only, mangled_old, mangled_new)
    paired = {n for pair in pairs for n in pair}
    differ, compared = 0, 0
    for name in names:
        if name in paired:
            continue
        compared += 1
        if name not in old or name not in new:
            print(f"{name}: only in {a.old if name in old else a.new}")
            differ += 1
        elif compare(name, old[name], new[name], a.top):
            differ += 1
    for o, n in pairs:  # the same kernel with other parameters: a difference whatever its counts
        compared += 1
        differ += 1
        compare(f"{o} -> {n} (its parameters differ)", old[o], new[n], a.top)
    print(f"{compared} kernel(s) compared, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
