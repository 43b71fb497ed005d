#!/usr/bin/env bash
# scripts/gpu/ncu_names.py on hand-made cubins whose mangled names are known: each written as Nsight Compute
# writes it (template arguments as (int)N, (bool)0/1 and qualified types, written out here by hand; a kernel
# without a template by its name; one with an argument of another kind as mangled), and layer-profile's own
# column-scan patterns counted against the seven forms they profile, as main has them and with a last
# template argument added (w-in-scan-x's, a bool or an int): each names exactly one kernel every way, `scan`
# the form with the argument 1; its two chunk_factors patterns each name the one form meant (ncu_lines.py finds
# the kernel's listing by the same patterns). A pattern naming nothing exits 1; a bad pattern and a file that is not ELF exit 2.
source "$(dirname "$0")/preamble.sh"
TOOL="$ROOT/scripts/gpu/ncu_names.py"
elf() { python3 "$ROOT/tests/cli/make_elf.py" "$@"; }
tool() {  # ARGS...: the tool's standard output into out, its exit status into rc
  set +e
  out=$(python3 "$TOOL" "$@" 2> "$TMP/err")
  rc=$?
  set -e
}

NS=_ZN2hh7kernels38_GLOBAL__N__9e3bd240_6_gdn_cu_8931c585  # the anonymous namespace of a build of gdn.cu
SCAN=18column_scan_kernelILi128ELi128ELin1EN3c108BFloat16E
PARAMS=EEvNS1_8ScanMapsEPKf
elf "$TMP/a.cubin" ".text.${NS}${SCAN}Lb0ELb0ELb1ELi1ELb1E${PARAMS}=00" ".text.${NS}14row_dot_kernelEPKfS3_Pfllb=00" \
  ".text._Z3fooIfLj7EEvv=00" ".text._Z1kILc65EEvv=00" ".nv.info=00"
tool "$TMP/a.cubin"
[[ $rc == 0 ]] || fail "names: exit $rc, $(cat "$TMP/err")"
want="_Z1kILc65EEvv
column_scan_kernel<(int)128, (int)128, (int)-1, c10::BFloat16, (bool)0, (bool)0, (bool)1, (int)1, (bool)1>
foo<float, (unsigned int)7>
row_dot_kernel"
[[ "$out" == "$want" ]] || fail "names: $out"

# layer-profile's patterns of the column scan, NAME=PATTERN.
mapfile -t pats < <(grep -oE "^\s+[a-z0-9-]+\) re='regex:column_scan_kernel[^']*'" "$ROOT/scripts/gpu/layer-profile" |
  sed -E "s/^\s+([a-z0-9-]+)\) re='([^']*)'/--pattern\n\1=\2/")
[[ ${#pats[@]} == 14 ]] || fail "layer-profile: ${#pats[@]} words for its column-scan patterns, not 7 patterns"
# Each entry's forms: HIST, DIR, WG (bool), UV (int), QK (bool) as mangled.
declare -A form=(
  [scan]=Lb0ELb0ELb1ELi1ELb1E [scan-qd]=Lb0ELb0ELb1ELi1ELb0E [scan-u16]=Lb0ELb0ELb1ELi0ELb0E
  [scan-hist]=Lb1ELb0ELb1ELi1ELb1E [scan-hist-qd]=Lb1ELb0ELb1ELi1ELb0E
  [reverse]=Lb1ELb1ELb1ELi0ELb1E [reverse-qd]=Lb1ELb1ELb1ELi0ELb0E)
# With the last argument a bool, the scan reading W is the other form; as an int, so is the scan scaling a step
# ahead (2).
main_specs=() kw_specs=(".text.${NS}${SCAN}${form[scan]}Lb0E${PARAMS}=00")
kwi_specs=(".text.${NS}${SCAN}${form[scan]}Li0E${PARAMS}=00" ".text.${NS}${SCAN}${form[scan]}Li2E${PARAMS}=00")
for k in "${!form[@]}"; do
  main_specs+=(".text.${NS}${SCAN}${form[$k]}${PARAMS}=00")
  kw=0; [[ $k == scan ]] && kw=1
  kw_specs+=(".text.${NS}${SCAN}${form[$k]}Lb${kw}E${PARAMS}=00")
  kwi_specs+=(".text.${NS}${SCAN}${form[$k]}Li${kw}E${PARAMS}=00")
done
elf "$TMP/main.cubin" "${main_specs[@]}"
elf "$TMP/kw.cubin" "${kw_specs[@]}"
elf "$TMP/kwi.cubin" "${kwi_specs[@]}"
for era in main kwi kw; do
  tool "$TMP/$era.cubin" "${pats[@]}"
  [[ $rc == 0 ]] || fail "$era: a pattern names no kernel: $out"
  [[ $(grep -c ": 1 kernel(s): " <<< "$out") == 7 ]] || fail "$era: not one kernel a pattern: $out"
done
grep -qxF "scan: 1 kernel(s): column_scan_kernel<(int)128, (int)128, (int)-1, c10::BFloat16, (bool)0, (bool)0, (bool)1, (int)1, (bool)1, (bool)1>" <<< "$out" ||
  fail "scan with the last argument: not the form that sets it: $out"
tool "$TMP/kwi.cubin" "${pats[@]}"
grep -qxF "scan: 1 kernel(s): column_scan_kernel<(int)128, (int)128, (int)-1, c10::BFloat16, (bool)0, (bool)0, (bool)1, (int)1, (bool)1, (int)1>" <<< "$out" ||
  fail "scan with the last argument an int: not the form 1: $out"

# layer-profile's two chunk_factors patterns against the forms main builds (DK, DV, T, OUT, PRE, MINB, TURN,
# CLOCKS; bfloat16 128 / 128 all six, and two others): each names the default four-block form.
FHEAD=_ZN2hh7kernels38_GLOBAL__N__5d0c1f2a_12_gdn_chunk_cu_77a1b2c320chunk_factors_kernelI
FPARAMS=EEvPKT1_S5_
fspecs=()
for f in Li128ELi128EN3c108BFloat16E{Lb0ELb0ELi4ELb0ELb0E,Lb1ELb0ELi2ELb1ELb0E,Lb1ELb0ELi2ELb1ELb1E,Lb1ELb0ELi4ELb0ELb0E,Lb1ELb1ELi3ELb0ELb0E,Lb1ELb1ELi4ELb0ELb0E} \
         Li128ELi128EN3c104HalfELb1ELb1ELi3ELb0ELb0E Li64ELi64EN3c108BFloat16ELb1ELb1ELi3ELb0ELb0E; do
  fspecs+=(".text.${FHEAD}${f}${FPARAMS}=00")
done
elf "$TMP/factors.cubin" "${fspecs[@]}"
mapfile -t fpats < <(grep -oE "^\s+(rule-)?factors\) re='regex:chunk_factors_kernel[^']*'" "$ROOT/scripts/gpu/layer-profile" |
  sed -E "s/^\s+([a-z-]+)\) re='([^']*)'/--pattern\n\1=\2/")
[[ ${#fpats[@]} == 4 ]] || fail "layer-profile: ${#fpats[@]} words for its chunk_factors patterns, not 2 patterns"
tool "$TMP/factors.cubin" "${fpats[@]}"
[[ $rc == 0 ]] || fail "chunk_factors: a pattern names no kernel: $out"
grep -qxF "factors: 1 kernel(s): chunk_factors_kernel<(int)128, (int)128, c10::BFloat16, (bool)1, (bool)1, (int)4, (bool)0, (bool)0>" <<< "$out" &&
  grep -qxF "rule-factors: 1 kernel(s): chunk_factors_kernel<(int)128, (int)128, c10::BFloat16, (bool)1, (bool)0, (int)4, (bool)0, (bool)0>" <<< "$out" ||
  fail "chunk_factors patterns: $out"

tool "$TMP/main.cubin" --pattern 'none=regex:column_scan_kernel<\(int\)64' --pattern 'any=column_scan_kernel'
[[ $rc == 1 ]] || fail "a pattern naming nothing: exit $rc"
grep -qx "none: 0 kernel(s)" <<< "$out" && grep -q "^any: 7 kernel(s): column_scan_kernel<" <<< "$out" || fail "counts: $out"
for bad in 'no-equals' 'x=regex:(' '=abc' 'x='; do
  tool "$TMP/main.cubin" --pattern "$bad"
  [[ $rc == 2 ]] || fail "--pattern '$bad': exit $rc"
done
echo "not elf" > "$TMP/text.cubin"
tool "$TMP/text.cubin"
[[ $rc == 2 ]] && grep -q "not a 64-bit little-endian ELF" "$TMP/err" || fail "not ELF: exit $rc, $(cat "$TMP/err")"
echo "ncu_names: names and pattern counts as expected"
