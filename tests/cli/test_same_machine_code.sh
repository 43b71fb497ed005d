#!/usr/bin/env bash
# scripts/gpu/same_machine_code.py on hand-made ELF files whose kernels are known: the same bytes under
# anonymous-namespace names hashed differently (the same), one kernel's bytes changed (differs), a kernel
# on one side only, a section that is not a kernel's (ignored), names rewritten by --rename to pair a
# template's forms across a dropped parameter, and a file that is not ELF.
source "$(dirname "$0")/preamble.sh"
TOOL="$ROOT/scripts/gpu/same_machine_code.py"

# elf OUT NAME=HEXBYTES ...: a stand-in cubin (make_elf.py).
elf() { python3 "$ROOT/tests/cli/make_elf.py" "$@"; }
# tool ARGS...: the comparison's standard output into out and its exit status into rc.
tool() {
  set +e
  out=$(python3 "$TOOL" "$@" 2> "$TMP/err")
  rc=$?
  set -e
}

A=.text._Z1av
ANON_OLD=.text._ZN2hh7kernels54_GLOBAL__N__228a9bad_21_gdn_chunk_backward_cu_0dae19c06kernelEv
ANON_NEW=.text._ZN2hh7kernels54_GLOBAL__N__7f01c3de_21_gdn_chunk_backward_cu_91ab22e46kernelEv
elf "$TMP/old.cubin" "$A=0011223344556677" "$ANON_OLD=8899aabb" ".nv.info=0102"
elf "$TMP/same.cubin" "$A=0011223344556677" "$ANON_NEW=8899aabb" ".nv.info=0304"

tool "$TMP/old.cubin" "$TMP/same.cubin"
[[ $rc == 0 ]] || fail "the same kernels under other hashes: exit $rc"
[[ "$out" == "2 kernels before, 2 after: 2 the same bytes, 0 differ, 0 only before, 0 only after" ]] || fail "same: $out"

elf "$TMP/changed.cubin" "$A=0011223344556678" "$ANON_NEW=8899aabb"
tool "$TMP/old.cubin" "$TMP/changed.cubin"
[[ $rc == 1 ]] || fail "a changed kernel: exit $rc"
grep -q "1 the same bytes, 1 differ" <<< "$out" || fail "changed: $out"
grep -qx "  differs: _Z1av" <<< "$out" || fail "changed kernel not named: $out"

elf "$TMP/fewer.cubin" "$A=0011223344556677" ".text._Z1bv=00"
tool "$TMP/old.cubin" "$TMP/fewer.cubin"
[[ $rc == 1 ]] || fail "kernels on one side only: exit $rc"
grep -qx "  only before: _ZN2hh7kernels54_GLOBAL__N_6kernelEv" <<< "$out" || fail "only before: $out"
grep -qx "  only after: _Z1bv" <<< "$out" || fail "only after: $out"

tool --names "$TMP/old.cubin" "$TMP/same.cubin"
grep -qx "  same: _Z1av" <<< "$out" || fail "--names: $out"

# --rename: a template's trailing parameter dropped. Before: k<false, false> (bytes 0a) and k<false, true>
# (0b); after: k<false> (0a). Unrenamed, nothing pairs; renamed, k<false, false> pairs with k<false> and
# k<false, true> is only before; a rule that maps both to one name, a rule without '=' and a bad pattern are refused.
KFF=.text._Z1kILb0ELb0EEvv KFT=.text._Z1kILb0ELb1EEvv KF=.text._Z1kILb0EEvv
elf "$TMP/tmpl-old.cubin" "$KFF=0a" "$KFT=0b"
elf "$TMP/tmpl-new.cubin" "$KF=0a"
tool "$TMP/tmpl-old.cubin" "$TMP/tmpl-new.cubin"
[[ "$out" == "2 kernels before, 1 after: 0 the same bytes, 0 differ, 2 only before, 1 only after"* ]] || fail "unrenamed: $out"
tool "$TMP/tmpl-old.cubin" "$TMP/tmpl-new.cubin" --rename '(_Z1kILb0E)Lb0E=\1'
[[ $rc == 1 ]] || fail "renamed, one form only before: exit $rc"
grep -qx "2 kernels before, 1 after: 1 the same bytes, 0 differ, 1 only before, 0 only after" <<< "$out" || fail "renamed: $out"
grep -qx "  only before: _Z1kILb0ELb1EEvv" <<< "$out" || fail "renamed, the form left: $out"
elf "$TMP/tmpl-old1.cubin" "$KFF=0a"
tool "$TMP/tmpl-old1.cubin" "$TMP/tmpl-new.cubin" --rename 'Lb0ELb0E=Lb0EX' --rename 'X='
[[ $rc == 0 && "$out" == "1 kernels before, 1 after: 1 the same bytes"* ]] || fail "two rules in order: exit $rc, $out"
for bad in '(_Z1kILb0E)Lb[01]E=\1' 'no-equals' '(unclosed=x'; do
  tool "$TMP/tmpl-old.cubin" "$TMP/tmpl-new.cubin" --rename "$bad"
  [[ $rc == 2 ]] || fail "--rename '$bad': exit $rc"
done
grep -q "become _Z1kILb0EEvv" <(python3 "$TOOL" "$TMP/tmpl-old.cubin" "$TMP/tmpl-new.cubin" --rename '(_Z1kILb0E)Lb[01]E=\1' 2>&1) ||
  fail "a collision is not named"

echo "not an ELF file" > "$TMP/text.cubin"
tool "$TMP/old.cubin" "$TMP/text.cubin"
[[ $rc == 2 ]] || fail "not ELF: exit $rc"
grep -q "text.cubin: not a 64-bit little-endian ELF file" "$TMP/err" || fail "not ELF: $(cat "$TMP/err")"
echo "ok"
