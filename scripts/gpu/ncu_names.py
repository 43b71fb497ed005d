#!/usr/bin/env python3
r"""Kernel names of cubins as Nsight Compute writes them, and which kernels its --kernel-name patterns name.

    python3 scripts/gpu/ncu_names.py gdn.cubin [more.cubin ...] [--pattern NAME=regex:PATTERN ...]

`layer-profile` picks each kernel it profiles by a regular expression over the kernel's demangled name, such as
`column_scan_kernel<(int)128, (int)128, (int)-1, c10::BFloat16, (bool)0, ...>` (ncu --kernel-name-base
demangled). A template parameter added to a kernel leaves such a pattern naming nothing, which otherwise shows
only once a GPU run has profiled nothing. This writes each kernel's template head (its name and arguments)
from its mangled name in that form: integers as (int)N, booleans as (bool)0 or (bool)1, types by their
qualified names (float, c10::BFloat16); a kernel without a template by its name alone. A name with any other
kind of argument is listed as it is mangled.

Without --pattern, prints the names, one a line, sorted. With --pattern NAME=PATTERN (repeatable; PATTERN as
layer-profile gives it, with or without `regex:`), prints for each the number of distinct kernels whose name
it matches (searched, as ncu searches) and the first of them. Exit 0; 1 when a pattern names no kernel; 2 on
unreadable input or a bad --pattern.
"""
import argparse
import os
import re
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from same_machine_code import kernels  # noqa: E402  (the cubin's kernels by mangled name)

BUILTIN = {"f": "float", "d": "double", "i": "int", "j": "unsigned int", "l": "long", "b": "bool"}
LITERAL = {"i": "int", "b": "bool", "j": "unsigned int", "l": "long"}


class Unreadable(Exception):
    """A mangled name with a part this reader does not take."""


def source_name(s, i):
    """(identifier, index after it) of <length><identifier> at s[i]."""
    m = re.compile(r"\d+").match(s, i)
    if not m:
        raise Unreadable(s[i:])
    n = int(m.group())
    return s[m.end():m.end() + n], m.end() + n


def template_arg(s, i):
    """(the argument as ncu writes it, index after it) at s[i]."""
    if s[i] == "L":  # a literal: L <type> [n] <digits> E
        m = re.compile(r"L([a-z])(n?)(\d+)E").match(s, i)
        if not m or m.group(1) not in LITERAL:
            raise Unreadable(s[i:])
        return f"({LITERAL[m.group(1)]}){'-' if m.group(2) else ''}{m.group(3)}", m.end()
    if s[i] == "N":  # a qualified type: N <name>... E
        parts, i = [], i + 1
        while s[i] != "E":
            part, i = source_name(s, i)
            parts.append(part)
        return "::".join(parts), i + 1
    if s[i] in BUILTIN:
        return BUILTIN[s[i]], i + 1
    if s[i].isdigit():  # an unqualified type
        return source_name(s, i)
    raise Unreadable(s[i:])


def ncu_name(mangled):
    """The kernel's template head as ncu writes it (its name alone without a template), or the mangled name
    where an argument is of another kind."""
    s = re.sub(r"\d+_GLOBAL__N_\w*?(?=\d+[A-Za-z_])", "", mangled)  # the anonymous namespace
    try:
        if s.startswith("_ZN"):
            i = 3
            while True:
                name, i = source_name(s, i)
                if not s[i].isdigit():
                    break
        elif s.startswith("_Z"):
            name, i = source_name(s, 2)
        else:
            return mangled
        if s[i] != "I":  # no template: the name alone
            return name
        args, i = [], i + 1
        while s[i] != "E":
            arg, i = template_arg(s, i)
            args.append(arg)
        return f"{name}<{', '.join(args)}>"
    except (Unreadable, IndexError):
        return mangled


def ncu_pattern(pattern):
    """A --kernel-name pattern as layer-profile gives ncu (with or without `regex:`) compiled, to be searched for
    in ncu_name's names; re.error where it is not a regular expression."""
    return re.compile(pattern[len("regex:"):] if pattern.startswith("regex:") else pattern)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cubins", nargs="+", help="cubins (nvcc -cubin, or cuobjdump -xelf of an object)")
    ap.add_argument("--pattern", action="append", default=[], metavar="NAME=PATTERN",
                    help="a kernel-name pattern to count the kernels of (repeatable)")
    args = ap.parse_args()
    names = set()
    for path in args.cubins:
        try:
            names |= {ncu_name(k) for k in kernels(path)}
        except (OSError, ValueError, struct.error) as e:
            print(f"ncu_names: {e}", file=sys.stderr)
            return 2
    names = sorted(names)
    patterns = []
    for spec in args.pattern:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or pattern in ("", "regex:"):
            print(f"ncu_names: --pattern {spec!r}: not NAME=PATTERN", file=sys.stderr)
            return 2
        try:
            patterns.append((name, ncu_pattern(pattern)))
        except re.error as e:
            print(f"ncu_names: --pattern {spec!r}: {e}", file=sys.stderr)
            return 2
    if not patterns:
        print("\n".join(names))
        return 0
    rc = 0
    for name, rx in patterns:
        hits = [n for n in names if rx.search(n)]
        print(f"{name}: {len(hits)} kernel(s){': ' + hits[0] if hits else ''}")
        rc |= not hits
    return rc


if __name__ == "__main__":
    sys.exit(main())
