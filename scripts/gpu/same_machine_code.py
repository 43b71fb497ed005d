#!/usr/bin/env python3
r"""Whether two builds of a CUDA file have the same machine code, kernel by kernel, from their cubins.

    nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I. -I<torch includes> -cubin kernels/gdn.cu -o new.cubin
    (the same on the tree before the change, into old.cubin)
    python3 scripts/gpu/same_machine_code.py old.cubin new.cubin [--names] [--rename PATTERN=REPLACEMENT ...]

A change meant to leave the kernels as they were (a refactor, a comment, a helper moved) needs no GPU run when
every kernel's code is the same bytes. A cubin is an ELF file with one section a kernel, `.text.<mangled
name>`; this compares those sections' bytes. The kernels of an anonymous namespace carry a hash of the
compilation in their mangled names (`_GLOBAL__N__228a9bad_21_gdn_chunk_backward_cu_0dae19c0`), which differs
between two builds of the same source; it is left out of the comparison. Prints the counts, then (with
--names, or for any that differ) the kernels that differ or that only one side has. Exit status 0 when all
are the same, 1 when any differ or are missing from one side, 2 on unreadable input or a bad --rename.

A change that adds or drops a template parameter renames every kernel of that template. --rename
PATTERN=REPLACEMENT (a Python regular expression and its replacement, as re.sub takes them; repeatable,
applied in order) rewrites the names before the change, after the hash is left out, so that they pair with
the names after it: for a trailing `bool WG = false` dropped from chunk_backward_kernel,
`--rename '(chunk_backward_kernelI(?:Li\d+E){2}N3c10\d+\w+?E(?:Lb[01]E){3})Lb0E=\1'`; the forms it
leaves unpaired (those with WG true) count as only before. Two kernels renamed to one name is an error.
"""
import argparse
import re
import struct
import sys

ANON = re.compile(r"_GLOBAL__N__[0-9a-fA-F]{8}_\d+_\w+?_cu_[0-9a-fA-F]{8}")


def kernels(path):
    """{normalised kernel name: its .text section's bytes} of an ELF64 little-endian cubin."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file (a cubin: nvcc -cubin)")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        end = data.index(b"\0", names_at + name_off)
        name = data[names_at + name_off:end].decode("ascii", "replace")
        if name.startswith(".text."):
            out[ANON.sub("_GLOBAL__N_", name[len(".text."):])] = data[offset:offset + size]
    return out


def renamed(named, rules):
    """named with each rule PATTERN=REPLACEMENT applied to its names in order (re.sub)."""
    for rule in rules:
        pattern, sep, replacement = rule.partition("=")
        if not sep or not pattern:
            raise ValueError(f"--rename {rule!r}: not PATTERN=REPLACEMENT")
        try:
            rx = re.compile(pattern)
            out = {}
            for name, code in named.items():
                to = rx.sub(replacement, name)
                if to in out:
                    raise ValueError(f"--rename {rule!r}: two kernels before the change become {to}")
                out[to] = code
        except re.error as e:
            raise ValueError(f"--rename {rule!r}: {e}")
        named = out
    return named


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="cubin of the tree before the change")
    ap.add_argument("new", help="cubin of the tree after it")
    ap.add_argument("--names", action="store_true", help="list every kernel, same or not")
    ap.add_argument("--rename", action="append", default=[], metavar="PATTERN=REPLACEMENT",
                    help="rewrite the names before the change (re.sub, in order) to pair them with those after it")
    a = ap.parse_args()
    try:
        old, new = kernels(a.old), kernels(a.new)
        old = renamed(old, a.rename)
    except (OSError, ValueError, struct.error) as e:
        print(f"same_machine_code: {e}", file=sys.stderr)
        return 2
    same = sorted(k for k in old if k in new and old[k] == new[k])
    differ = sorted(k for k in old if k in new and old[k] != new[k])
    only_old, only_new = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    print(f"{len(old)} kernels before, {len(new)} after: {len(same)} the same bytes, {len(differ)} differ, "
          f"{len(only_old)} only before, {len(only_new)} only after")
    for label, names in (("differs", differ), ("only before", only_old), ("only after", only_new)) + (
            (("same", same),) if a.names else ()):
        for k in names:
            print(f"  {label}: {k}")
    return 0 if not (differ or only_old or only_new) else 1


if __name__ == "__main__":
    sys.exit(main())
