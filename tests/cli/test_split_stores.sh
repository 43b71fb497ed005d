#!/usr/bin/env bash
# scripts/gpu/split_stores.py on a hand-made PTX file whose split accesses are known: a 16-byte store
# written as four 4-byte ones, a 16-bit one in eight pieces with a vector piece among them, whole vector
# stores, neighbouring stores through different base registers, and the 16-byte blocks' boundaries.
source "$(dirname "$0")/preamble.sh"

# Kernel a (line 10 of k.cu): four st.global.u32 at [%rd1] .. +12 (3 continued pieces), then a
# st.global.v4.u32 (whole), then [%rd2] and [%rd3] at the same offsets (different bases: none), then
# [%rd4+16] after [%rd4+12] (a new 16-byte block: none). Line 11: st.shared.u32 [%r1], [%r1+4] (1, shared).
# Line 12: a load split in two (1, a load). Kernel b: eight 16-bit pieces, one of them a v2 (6 continued:
# +2, +4 (the v2), +8, +10, +12, +14; +8 follows the v2's 4 bytes at +4). Kernel c: nothing split.
cat > "$TMP/k.ptx" <<'PTX'
.version 8.0
.target sm_90a
.address_size 64

.visible .entry _Z1av(
)
{
	.loc	1 10 3
	st.global.u32 	[%rd1], %r1;
	add.s32 	%r9, %r9, 1;
	st.global.u32 	[%rd1+4], %r2;
	st.global.u32 	[%rd1+8], %r3;
	st.global.u32 	[%rd1+12], %r4;
	st.global.v4.u32 	[%rd5], {%r1, %r2, %r3, %r4};
	st.global.u32 	[%rd2], %r1;
	st.global.u32 	[%rd3+4], %r1;
	st.global.u32 	[%rd4+12], %r1;
	st.global.u32 	[%rd4+16], %r1;
	.loc	1 11 3
	st.shared.u32 	[%r1], %r5;
	st.shared.u32 	[%r1+4], %r6;
	.loc	1 12 3
	ld.global.nc.u32 	%r7, [%rd6];
	ld.global.nc.u32 	%r8, [%rd6+4];
	ret;
}
.entry _ZN12_GLOBAL__N_11bEv(
)
{
	.loc	1 20 3
	st.global.u16 	[%rd1], %rs1;
	st.global.u16 	[%rd1+2], %rs2;
	st.global.v2.u16 	[%rd1+4], {%rs3, %rs4};
	st.global.u16 	[%rd1+8], %rs5;
	st.global.u16 	[%rd1+10], %rs6;
	st.global.u16 	[%rd1+12], %rs7;
	st.global.u16 	[%rd1+14], %rs8;
	ret;
}
.visible .entry _Z1cv(
)
{
	st.global.v4.u32 	[%rd1], {%r1, %r2, %r3, %r4};
	st.global.v2.f32 	[%rd2], {%f1, %f2};
	ret;
}
	.file	1 "/src/kernels/k.cu"
PTX

# has REGEX: a line of the last output matches the extended regular expression.
has() { grep -qE "$1" <<<"$out"; }

out=$(python3 "$ROOT/scripts/gpu/split_stores.py" "$TMP/k.ptx")
has "^k\.ptx: a(\(\))?: 3 continued pieces$" || fail "kernel a's global stores: $out"
has "^ +3  st\.global +k\.cu:10$" || fail "kernel a's line: $out"
has "^k\.ptx: b(\(\))?: 6 continued pieces$" || fail "kernel b (its anonymous namespace dropped): $out"
has "^ +6  st\.global +k\.cu:20$" || fail "kernel b's line: $out"
has ": c" && fail "kernel c has nothing split: $out"
has "shared" && fail "shared stores listed without --space: $out"

out=$(python3 "$ROOT/scripts/gpu/split_stores.py" "$TMP/k.ptx" --space all --loads --kernel _Z1a)
has "^k\.ptx: a(\(\))?: 5 continued pieces$" || fail "kernel a, all spaces and loads: $out"
has "^ +1  st\.shared +k\.cu:11$" || fail "the shared store: $out"
has "^ +1  ld\.global +k\.cu:12$" || fail "the split load: $out"
has ": b" && fail "--kernel _Z1a listed b: $out"

# --fail: status 1 when anything is listed, 0 when nothing is.
if python3 "$ROOT/scripts/gpu/split_stores.py" "$TMP/k.ptx" --fail > /dev/null; then fail "--fail with split stores"; fi
out=$(python3 "$ROOT/scripts/gpu/split_stores.py" "$TMP/k.ptx" --fail --kernel _Z1c) || fail "--fail with none: $out"
[[ "$out" == "no split accesses" ]] || fail "nothing listed: $out"
if python3 "$ROOT/scripts/gpu/split_stores.py" "$TMP/missing.ptx" 2> "$TMP/err.txt"; then fail "a missing file was accepted"; fi
grep -q "missing.ptx: no such file" "$TMP/err.txt" || fail "missing file message: $(cat "$TMP/err.txt")"
echo "split_stores: ok"
