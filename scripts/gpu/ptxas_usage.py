#!/usr/bin/env python3
"""Each kernel's registers, spill and compiler-injected warpgroup waits, from ptxas's own report, for one build
of a CUDA file or two side by side.

    nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -Xptxas -v -I. -I<torch includes> -cubin \\
        kernels/FILE.cu -o new.cubin 2> new.txt
    (the same on the tree before the change, into old.txt)
    python3 scripts/gpu/ptxas_usage.py new.txt                  # a row a kernel
    python3 scripts/gpu/ptxas_usage.py old.txt new.txt [--changed] [--kernel REGEX] [--rename PATTERN=REPLACEMENT ...]

A change to a kernel that sits at its register limit (chunk_backward: 128 a thread, 16 warps a block) can
push values into local memory anywhere in it; ptxas says so for each entry function ("N bytes spill stores").
And where ptxas cannot keep a wgmma's accumulators in place it injects warpgroup.arrive / warpgroup.wait
(warnings C7517 / C7519), which serialise the products; those are counted a kernel here ("injected").
Kernels are named by their demangled names up to the parameter list (c++filt, where it is on the PATH; the
mangled name otherwise), with the anonymous namespace's per-build hash left out, so two builds pair up.
A change that adds or drops a template parameter renames every kernel of that template: --rename rewrites the
first report's names (re.sub on the names as printed, the rules in order, as same_machine_code.py's option)
so that they pair, for example `--rename '(column_scan_kernel<.*)>$=\\1, false>'` for a new last flag.

Prints a Markdown table: a row a kernel (of those --kernel's regular expression finds in the name), its
registers, spill stores / loads in bytes, stack frame, injected waits; with two reports, old -> new for each
and a mark on the rows that differ (--changed: only those rows, and the kernels on one side only).
Exit 0; with two reports, 1 when any kernel spills more bytes (stored or loaded) or has more injected waits in
the second than in the first (or is in one report only); 2 on a report with no entry function, an unreadable one,
or a bad --rename (no '=', a bad pattern, two kernels renamed to one name).
"""
import argparse
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from same_machine_code import ANON, renamed  # noqa: E402  the anonymous namespace's hash; --rename's rules
from sass_ops import without_parameters  # noqa: E402  c++filt, up to the parameter list

ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")
INJECTED = re.compile(r"\(C75(?:17|19)\).* in function '([^']+)'")
FIELDS = ("registers", "spill stores", "spill loads", "stack", "injected")


class BadReport(Exception):
    pass


def read_report(path):
    """{mangled name: {field: value}} for each entry function of one `ptxas -v` report."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise BadReport(f"{path}: {e.strerror}")
    out, entry, props = {}, None, None
    for line in lines:
        m = ENTRY.search(line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, dict.fromkeys(FIELDS, 0))
            props = None
            continue
        m = PROPERTIES.search(line)
        if m:
            props = m.group(1)  # a device function's properties may follow; only the entry's count
            continue
        m = FRAME.search(line)
        if m and entry is not None and props == entry:
            k = out[entry]
            k["stack"], k["spill stores"], k["spill loads"] = (int(g) for g in m.groups())
            continue
        m = USED.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
            continue
        m = INJECTED.search(line)
        if m:
            out.setdefault(m.group(1), dict.fromkeys(FIELDS, 0))["injected"] += 1
    if not out:
        raise BadReport(f"{path}: no \"Compiling entry function\" line (nvcc ... -Xptxas -v, its standard error)")
    return out


def by_name(report):
    """{readable name: fields}: demangled up to the parameter list, the anonymous namespace's hash left out."""
    plain = without_parameters(sorted(report))
    out = {}
    for mangled, fields in report.items():
        name = plain.get(mangled, ANON.sub("_GLOBAL__N_", mangled))
        name = name.replace("(anonymous namespace)::", "")
        if name.startswith("void "):  # a function template's return type, which c++filt prints
            name = name[len("void "):]
        if name in out:  # two overloads that differ in parameters only: keep them apart
            name = ANON.sub("_GLOBAL__N_", mangled)
        out[name] = fields
    return out


def cells(fields):
    return [str(fields["registers"]), f"{fields['spill stores']} / {fields['spill loads']}", str(fields["stack"]),
            str(fields["injected"])]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", metavar="REPORT", help="ptxas -v output (one, or old and new)")
    p.add_argument("--kernel", default="", help="regular expression a kernel's readable name must contain")
    p.add_argument("--changed", action="store_true", help="with two reports: only the kernels that differ")
    p.add_argument("--rename", action="append", default=[], metavar="PATTERN=REPLACEMENT",
                   help="with two reports: rewrite the first one's names (re.sub, in order) to pair them with the second's")
    a = p.parse_args()
    if len(a.reports) > 2:
        p.error("one report, or two (old and new)")
    if a.rename and len(a.reports) != 2:
        p.error("--rename pairs two reports")
    try:
        pattern = re.compile(a.kernel)
    except re.error as e:
        p.error(f"--kernel: {e}")
    try:
        reports = [by_name(read_report(r)) for r in a.reports]
        if a.rename:
            reports[0] = renamed(reports[0], a.rename)
    except (BadReport, ValueError) as e:
        print(f"ptxas_usage: {e}", file=sys.stderr)
        return 2
    head = "| kernel | registers | spill stores / loads (bytes) | stack (bytes) | injected waits |"
    if len(reports) == 1:
        print(head + "\n|---|---|---|---|---|")
        for name in sorted(n for n in reports[0] if pattern.search(n)):
            print(f"| {name} | " + " | ".join(cells(reports[0][name])) + " |")
        return 0
    old, new = reports
    worse = False
    print(head + " |\n|---|---|---|---|---|---|")  # and a column for "changed" or the side a kernel is on
    for name in sorted(n for n in set(old) | set(new) if pattern.search(n)):
        o, n = old.get(name), new.get(name)
        if o is None or n is None:
            worse = True
            side = "new" if o is None else "old"
            print(f"| {name} | " + " | ".join(cells(n or o)) + f" | only in the {side} report |")
            continue
        differs = o != n
        if any(n[f] > o[f] for f in ("spill stores", "spill loads", "injected")):
            worse = True
        if a.changed and not differs:
            continue
        row = [x if x == y else f"{x} -> {y}" for x, y in zip(cells(o), cells(n))]
        print(f"| {name} | " + " | ".join(row) + (" | changed |" if differs else " | |"))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
