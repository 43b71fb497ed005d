#!/usr/bin/env bash
# scripts/gpu/sass_ops.py on hand-written cuobjdump -sass listings whose counts are known: a kernel whose
# opcodes changed (two more LDG, one BAR fewer, a predicated HMMA counted as HMMA), one the same under
# anonymous-namespace names hashed differently, one on one side only; --kernel narrows the kernels,
# --modifiers counts whole mnemonics; a kernel whose parameters changed type (a float pointer become a struct)
# paired by its demangled name without them, where c++filt is on the PATH; a file with no kernel and a pattern matching none exit 2.
source "$(dirname "$0")/preamble.sh"
TOOL="$ROOT/scripts/gpu/sass_ops.py"
ins() { printf '        /*%04x*/              %s ;                  /* 0x000fe20000000800 */\n' "$1" "$2"
        printf '                                                     /* 0x000fc40000000f00 */\n'; }
{
  printf '\tcode for sm_90a\n\t\tFunction : _Z4stepPf\n\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"\n'
  ins 0 "LDC R1, c[0x0][0x28]"; ins 16 "LDG.E.128 R4, desc[UR4][R2.64]"; ins 32 "BAR.SYNC.DEFER_BLOCKING 0x0"
  ins 48 "BAR.SYNC.DEFER_BLOCKING 0x0"; ins 64 "@!P0 HMMA.16816.F32 R8, R4, R6, R8"; ins 80 "EXIT"
  printf '\t\tFunction : _ZN12_GLOBAL__N__1a2b3c4d_9_gdn_cu_0dae19c04scanEv\n'
  ins 0 "S2R R0, SR_TID.X"; ins 16 "EXIT"
  printf '\t\tFunction : _Z3oldv\n'; ins 0 "EXIT"
} > "$TMP/old.sass"
{
  printf '\tcode for sm_90a\n\t\tFunction : _Z4stepPf\n'
  ins 0 "LDC R1, c[0x0][0x28]"; ins 16 "LDG.E.128 R4, desc[UR4][R2.64]"; ins 32 "LDG.E R5, desc[UR4][R2.64]"
  ins 48 "LDG.E R7, desc[UR4][R2.64]"; ins 64 "BAR.SYNC.DEFER_BLOCKING 0x0"; ins 80 "HMMA.16816.F32 R8, R4, R6, R8"
  ins 96 "EXIT"
  printf '\t\tFunction : _ZN12_GLOBAL__N__99887766_9_gdn_cu_112233444scanEv\n'
  ins 0 "S2R R0, SR_TID.X"; ins 16 "EXIT"
} > "$TMP/new.sass"

rc=0; out=$(python3 "$TOOL" "$TMP/old.sass" "$TMP/new.sass") || rc=$?
[[ $rc == 1 ]] || fail "differing kernels: exit $rc: $out"
grep -qx "_Z4stepPf: 6 -> 7 instructions (+1)" <<<"$out" || fail "step's totals: $out"
grep -qE "^    LDG +1 -> 3 +\+2$" <<<"$out" || fail "step's LDG: $out"
grep -qE "^    BAR +2 -> 1 +-1$" <<<"$out" || fail "step's BAR: $out"
! grep -qE "^    (HMMA|LDC|EXIT) " <<<"$out" || fail "an opcode with the same count listed: $out"
grep -qx "_ZN12_GLOBAL__N_4scanEv: the same counts, 2 instructions" <<<"$out" || fail "the anonymous kernel: $out"
grep -qx "_Z3oldv: only in $TMP/old.sass" <<<"$out" || fail "a kernel on one side: $out"
grep -qx "3 kernel(s) compared, 2 differ" <<<"$out" || fail "the count line: $out"
[[ $(grep -A1 "_Z4stepPf:" <<<"$out" | tail -1) == *LDG* ]] || fail "the largest difference is not first: $out"

out=$(python3 "$TOOL" "$TMP/old.sass" "$TMP/new.sass" --kernel scan) || fail "--kernel scan: exit $?: $out"
[[ "$out" == *"1 kernel(s) compared, 0 differ"* ]] || fail "--kernel scan: $out"
out=$(python3 "$TOOL" "$TMP/old.sass" "$TMP/new.sass" --kernel step --modifiers) && fail "--modifiers: exit 0"
grep -qE "^    LDG\.E +0 -> 2 +\+2$" <<<"$out" || fail "--modifiers: LDG.E not counted apart: $out"
grep -qE "^    LDG\.E\.128 " <<<"$out" && fail "--modifiers: LDG.E.128 listed with an unchanged count: $out"

rc=0; err=$(python3 "$TOOL" "$TMP/old.sass" "$TMP/new.sass" --kernel nomatch 2>&1) || rc=$?
[[ $rc == 2 ]] && grep -q "no kernel matches 'nomatch'" <<<"$err" || fail "no match: exit $rc, $err"
echo "not a listing" > "$TMP/bad.sass"
rc=0; err=$(python3 "$TOOL" "$TMP/bad.sass" "$TMP/new.sass" 2>&1) || rc=$?
[[ $rc == 2 ]] && grep -q "bad.sass: no kernel" <<<"$err" || fail "not a listing: exit $rc, $err"
# Two float pointers become GateIn<BFloat16>: one kernel, its parameters changed, under other namespace
# hashes; a second, other template argument on one side stays unpaired.
a1=_GLOBAL__N__1a2b3c4d_9_gdn_cu_0dae19c0 a2=_GLOBAL__N__99887766_9_gdn_cu_11223344
pre=21chunk_backward_kernelILi128ELi128EN3c108BFloat16ELb1ELb1E
{
  printf '\t\tFunction : _ZN2hh7kernels%d%s%sLb0EEEvPKT1_S7_S7_PKfS9_S7_\n' ${#a1} $a1 $pre; ins 0 "LDG.E R1, desc[UR4][R2.64]"; ins 16 "EXIT"
} > "$TMP/p-old.sass"
{
  printf '\t\tFunction : _ZN2hh7kernels%d%s%sLb0EEEvPKT1_S7_S7_NS1_6GateInIS5_EES9_S7_\n' ${#a2} $a2 $pre
  ins 0 "LDG.E R1, desc[UR4][R2.64]"; ins 16 "LD.E R2, [R4.64]"; ins 32 "EXIT"
  printf '\t\tFunction : _ZN2hh7kernels%d%s%sLb1EEEvPKT1_S7_S7_NS1_6GateInIS5_EES9_S7_\n' ${#a2} $a2 $pre; ins 0 "EXIT"
} > "$TMP/p-new.sass"
if command -v c++filt > /dev/null; then
  rc=0; out=$(python3 "$TOOL" "$TMP/p-old.sass" "$TMP/p-new.sass") || rc=$?
  [[ $rc == 1 ]] || fail "changed parameters: exit $rc: $out"
  grep -qE "^_ZN.*Lb0EEEvPKT1_S7_S7_PKfS9_S7_ -> _ZN.*Lb0EEEvPKT1_S7_S7_NS1_6GateIn.* \(its parameters differ\): 2 -> 3 instructions \(\+1\)$" <<<"$out" ||
    fail "the kernel with other parameters not paired: $out"
  grep -qE "^    LD +0 -> 1 +\+1$" <<<"$out" || fail "its LD: $out"
  grep -qE "Lb1EEEv.*: only in $TMP/p-new.sass$" <<<"$out" || fail "the other kernel: $out"
  grep -qx "2 kernel(s) compared, 2 differ" <<<"$out" || fail "the count line with a pair: $out"
fi
echo "sass_ops: ok"
