#!/usr/bin/env python3
"""make_elf.py OUT NAME=HEXBYTES ...: an ELF64 little-endian file with a null section, one section a NAME holding
those bytes, and the section-name table last: a stand-in cubin for the tests of scripts/gpu's cubin readers."""
import struct, sys
out, specs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in specs) + b".shstrtab\0"
body, headers, at, name_at = b"", [b"\0" * 64], 64, 1
for n, hexbytes in specs:
    blob = bytes.fromhex(hexbytes)
    headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 6, 0, at + len(body), len(blob), 0, 0, 16, 0))
    body += blob
    name_at += len(n) + 1
headers.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, at + len(body), len(names), 0, 0, 1, 0))
body += names
shoff = at + len(body)
ident = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
head = ident + struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1)
open(out, "wb").write(head + body + b"".join(headers))
