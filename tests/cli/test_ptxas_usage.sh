#!/usr/bin/env bash
# scripts/gpu/ptxas_usage.py on hand-made `ptxas -v` reports whose figures are known: two builds of one file
# (their anonymous namespaces hashed differently, so the kernels pair only by name), a device function's
# properties between an entry's lines (not the entry's), injected-wait warnings counted a kernel, a kernel
# in one build only, one paired by --rename; the exit status that flags more spill or more injected waits;
# the errors.
source "$(dirname "$0")/preamble.sh"
TOOL="$ROOT/scripts/gpu/ptxas_usage.py"

# Itanium names: hh::kernels::(anonymous namespace)::scan<64>(float*) and step<1>(float*), the anonymous
# namespace as nvcc names it in a build (its 39 characters: hash, file, hash).
scan() { echo "_ZN2hh7kernels39_GLOBAL__N__$1_7_demo_cu_$2$3"; }
ANON_A=(11111111 22222222) ANON_B=(33333333 44444444)
SCAN=4scanILi64EEEvPf STEP=4stepILi1EEEvPf WIDE=4wideILi2EEEvPf

cat > "$TMP/old.txt" <<EOF
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '$(scan "${ANON_A[@]}" $SCAN)' for 'sm_90a'
ptxas info    : Function properties for $(scan "${ANON_A[@]}" $SCAN)
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Function properties for _Z6helperv
    32 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
ptxas info    : Compile time = 1.000 ms
ptxas info    : (C7519) warpgroup.arrive is injected in around line 10 by compiler to allow use of registers in GMMA in function '$(scan "${ANON_A[@]}" $STEP)'
ptxas info    : (C7517) warpgroup.wait is injected in around line 12 by compiler to allow use of registers defined by GMMA in function '$(scan "${ANON_A[@]}" $STEP)'
ptxas info    : Compiling entry function '$(scan "${ANON_A[@]}" $STEP)' for 'sm_90a'
ptxas info    : Function properties for $(scan "${ANON_A[@]}" $STEP)
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
EOF
# The new build: scan spills 8 bytes more (4 -> 12) on 127 registers, step loses one injected wait, wide is new.
cat > "$TMP/new.txt" <<EOF
ptxas info    : Compiling entry function '$(scan "${ANON_B[@]}" $SCAN)' for 'sm_90a'
ptxas info    : Function properties for $(scan "${ANON_B[@]}" $SCAN)
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers
ptxas info    : (C7519) warpgroup.arrive is injected in around line 10 by compiler to allow use of registers in GMMA in function '$(scan "${ANON_B[@]}" $STEP)'
ptxas info    : Compiling entry function '$(scan "${ANON_B[@]}" $STEP)' for 'sm_90a'
ptxas info    : Function properties for $(scan "${ANON_B[@]}" $STEP)
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
ptxas info    : Compiling entry function '$(scan "${ANON_B[@]}" $WIDE)' for 'sm_90a'
ptxas info    : Used 40 registers
EOF

# Names as printed: demangled where c++filt is on the PATH, else the mangled name without the build's hash.
if command -v c++filt > /dev/null; then
  N_SCAN="hh::kernels::scan<64>" N_STEP="hh::kernels::step<1>" N_WIDE="hh::kernels::wide<2>"
else
  N_SCAN="_ZN2hh7kernels39_GLOBAL__N_${SCAN}" N_STEP="_ZN2hh7kernels39_GLOBAL__N_${STEP}"
  N_WIDE="_ZN2hh7kernels39_GLOBAL__N_${WIDE}"
fi
run() {  # the tool's output into out, its exit status into rc
  set +e
  out=$(python3 "$TOOL" "$@" 2> "$TMP/err.txt")
  rc=$?
  set -e
}

run "$TMP/old.txt"
[[ $rc == 0 ]] || fail "one report: exit $rc, $(cat "$TMP/err.txt")"
[[ "$(wc -l <<<"$out")" == 4 ]] || fail "a header, its rule and a row a kernel: $out"
grep -qxF "| $N_SCAN | 128 | 4 / 4 | 8 | 0 |" <<<"$out" || fail "scan's row (not the helper's 16 bytes): $out"
grep -qxF "| $N_STEP | 96 | 0 / 0 | 0 | 2 |" <<<"$out" || fail "step's row, two injected waits: $out"

run "$TMP/old.txt" "$TMP/new.txt"
[[ $rc == 1 ]] || fail "more spill in the new report: exit $rc, not 1: $out"
grep -qxF "| $N_SCAN | 128 -> 127 | 4 / 4 -> 12 / 12 | 8 -> 16 | 0 | changed |" <<<"$out" || fail "scan paired: $out"
grep -qxF "| $N_STEP | 96 | 0 / 0 | 0 | 2 -> 1 | changed |" <<<"$out" || fail "step paired: $out"
grep -qxF "| $N_WIDE | 40 | 0 / 0 | 0 | 0 | only in the new report |" <<<"$out" || fail "wide: $out"

# The other way round: less spill, more injected waits (step 1 -> 2), and wide only in the old report.
run "$TMP/new.txt" "$TMP/old.txt"
[[ $rc == 1 ]] || fail "more injected waits: exit $rc, not 1: $out"

# scan alone, only its spill loads grown (4 / 4 -> 4 / 12): worse, exit 1.
sed 's/4 bytes spill stores, 4 bytes spill loads/4 bytes spill stores, 12 bytes spill loads/' "$TMP/old.txt" > "$TMP/loads.txt"
run "$TMP/old.txt" "$TMP/loads.txt" --kernel scan
[[ $rc == 1 ]] && grep -qxF "| $N_SCAN | 128 | 4 / 4 -> 4 / 12 | 8 | 0 | changed |" <<<"$out" || fail "more spill loads: exit $rc, $out"

# Only step, by --kernel: fewer waits and nothing else worse, so exit 0; --changed keeps its row.
run "$TMP/old.txt" "$TMP/new.txt" --kernel 'step' --changed
[[ $rc == 0 ]] || fail "step alone is not worse: exit $rc: $out"
[[ "$(wc -l <<<"$out")" == 3 ]] && grep -qF "| $N_STEP |" <<<"$out" || fail "--kernel step --changed: $out"

# The same build twice: nothing changed, no rows with --changed, exit 0.
run "$TMP/old.txt" "$TMP/old.txt" --changed
[[ $rc == 0 && "$(wc -l <<<"$out")" == 2 ]] || fail "the same report twice: exit $rc, $out"

# --rename: the old build's wide<3> (a template argument the change rewrote) pairs with the new build's wide<2>
# once its name is rewritten (the rule matches the printed name, demangled or not); unpaired, both are on one
# side only (exit 1). A rule without '=', a bad pattern, two kernels renamed to one name, or a rule with one
# report: exit 2.
{ cat "$TMP/old.txt"; echo "ptxas info    : Compiling entry function '$(scan "${ANON_A[@]}" 4wideILi3EEEvPf)' for 'sm_90a'"
  echo "ptxas info    : Used 40 registers"; } > "$TMP/old-wide.txt"
run "$TMP/old-wide.txt" "$TMP/new.txt" --kernel wide
[[ $rc == 1 && "$(grep -c "only in the" <<<"$out")" == 2 ]] || fail "wide<3> and wide<2> unpaired: exit $rc, $out"
run "$TMP/old-wide.txt" "$TMP/new.txt" --kernel wide --rename 'wide(<|ILi)3=wide\g<1>2'
[[ $rc == 0 ]] && grep -qxF "| $N_WIDE | 40 | 0 / 0 | 0 | 0 | |" <<<"$out" && ! grep -q "only in the" <<<"$out" ||
  fail "wide paired by --rename: exit $rc, $out, $(cat "$TMP/err.txt")"
for bad in 'no-equals' '(=x' '.*=same'; do
  run "$TMP/old.txt" "$TMP/new.txt" --rename "$bad"
  [[ $rc == 2 ]] && grep -q "^ptxas_usage: --rename" "$TMP/err.txt" || fail "--rename '$bad': exit $rc, $(cat "$TMP/err.txt")"
done
run "$TMP/old.txt" --rename 'a=b'
[[ $rc == 2 ]] || fail "--rename with one report: exit $rc"

# Errors: a file with no entry function (named), a missing file, three reports.
echo "nvcc fatal: no input" > "$TMP/empty.txt"
run "$TMP/empty.txt"
[[ $rc == 2 ]] && grep -q "^ptxas_usage: $TMP/empty.txt: no \"Compiling entry function\" line" "$TMP/err.txt" ||
  fail "a report without entries: exit $rc, $(cat "$TMP/err.txt")"
run "$TMP/none.txt"
[[ $rc == 2 ]] && grep -q "none.txt" "$TMP/err.txt" || fail "no such file: exit $rc, $(cat "$TMP/err.txt")"
run "$TMP/old.txt" "$TMP/old.txt" "$TMP/old.txt"
[[ $rc == 2 ]] || fail "three reports: exit $rc"
echo "ok"
