#!/usr/bin/env bash
# scripts/gpu/ab-bench's builds, in a scratch repository whose scripts/gpu-check is a stand-in (the real
# one needs nvcc and a CUDA LibTorch): it records each build's folder and leaves a CLI whose `bench gdn
# --json` reports forward + backward as the number in kernels/marker (2.0 without it). With variants and
# a clean tree the base is this tree, built once, and so with changes only where no build reads (an
# untracked candidate patch, an edited doc); with an untracked file elsewhere the base is built apart, as
# `this` beside it, and the log names the file; a failing build (the tree's, or the base's built apart)
# ends the run with exit 1. With --tests each build's GPU tests (stand-ins naming the build's marker) run
# after the benches, from copies of that build's own binaries, and a failing one makes the exit status
# nonzero after the figures. Where the base is built apart, the variants are also summed against this tree;
# --base-tree makes a changed tree the base, built once. --tests-variants runs the variants' tests only.
# --budget cuts the rounds of runs, the traces and the tests that would end past it, and says so. The log's
# second line is the tree's fingerprint, which files no build reads leave as it is. The
# stand-in compiles as make does (only a marker newer than its object), so that a variant's object left in
# the build folder and the tree's marker given back its older time would make a stale base but for the
# files ab-bench touches first.
source "$(dirname "$0")/preamble.sh"
repo="$TMP/repo"
mkdir -p "$repo/scripts/gpu" "$repo/kernels"
cp "$ROOT/scripts/gpu/ab-bench" "$ROOT/scripts/gpu/ab_summary.py" "$ROOT/scripts/gpu/gpu_tests.sh" "$ROOT/scripts/gpu/variants.sh" \
  "$ROOT/scripts/gpu/tree-overlay" \
  "$repo/scripts/gpu/"
cat > "$repo/scripts/gpu-check" <<'STUB'
#!/usr/bin/env bash
echo "$PWD" >> "$AB_TEST_BUILDS"
[[ "$PWD" != "${AB_TEST_FAIL:-}" ]] || exit 3
mkdir -p build-gpu/bin build-gpu/obj
# make's rule: the marker's object is compiled again unless it is newer than the marker (the same time
# counts as not newer, as a file system's coarse clock can give two quick writes one time)
if [[ -e kernels/marker ]]; then
  [[ build-gpu/obj/marker -nt kernels/marker ]] || cp kernels/marker build-gpu/obj/marker
else
  rm -f build-gpu/obj/marker
fi
ms=$(cat build-gpu/obj/marker 2>/dev/null || echo 2.0)
printf '#!/usr/bin/env bash\nsleep "${AB_TEST_BENCH_SLEEP:-0}"\necho "{\\"rows\\": [{\\"B\\": 1, \\"T\\": 32768, \\"fwd_bwd_b2b_ms\\": %s, \\"fwd_b2b_ms\\": 0.5}]}"\n' "$ms" \
  > build-gpu/bin/hydrahead
chmod +x build-gpu/bin/hydrahead
mkdir -p build-gpu/tests
for t in gpu_test_cuda_gdn gpu_test_cuda_train gpu_test_cuda_hybrid; do
  if [[ -e kernels/failtest ]]; then
    printf '#!/usr/bin/env bash\necho "marker %s"\necho "[  FAILED  ] 1 test, listed below:"\nexit 1\n' "$ms" > build-gpu/tests/$t
  else
    printf '#!/usr/bin/env bash\necho "marker %s"\necho "[  PASSED  ] 1 test."\n' "$ms" > build-gpu/tests/$t
  fi
  chmod +x build-gpu/tests/$t
done
STUB
mkdir -p "$repo/docs" && echo "figures" > "$repo/docs/BENCHMARKS.md"
commit_scratch_repo "$repo"
mkdir -p "$TMP/v/kernels" && echo 1.5 > "$TMP/v/kernels/marker"

run() {  # NAME [ARGS...]: ab-bench with variant v (and ARGS) in the scratch repository; its exit status
  local name=$1; shift
  export AB_TEST_BUILDS="$TMP/builds-$name"
  : > "$AB_TEST_BUILDS"
  (cd "$repo" && OUT="$TMP/out-$name" HH_AB_BASE_DIR="$TMP/base-$name" HH_AB_BIN_DIR="$TMP/bin-$name" \
    ./scripts/gpu/ab-bench --variant "v=$TMP/v" --runs 1 "$@" > "$TMP/log-$name" 2>&1)
}

# The clean run with a stand-in nvidia-smi: the device's name and power limit head the log.
mkdir -p "$TMP/smi" && printf '#!/usr/bin/env bash\necho "NVIDIA H200, 700.00 W"\n' > "$TMP/smi/nvidia-smi" && chmod +x "$TMP/smi/nvidia-smi"
PATH="$TMP/smi:$PATH" run clean || fail "clean tree: exit $?: $(cat "$TMP/log-clean")"
ab="$TMP/out-clean/ab.txt"
[[ "$(head -1 "$ab")" == "==> device: NVIDIA H200, 700.00 W" ]] || fail "the device is not the log's first line: $(head -3 "$ab")"
grep -q "this tree as it stands: built once" "$ab" || fail "clean tree, not built once: $(cat "$ab")"
[[ $(wc -l < "$TMP/builds-clean") == 2 ]] || fail "clean tree: builds $(cat "$TMP/builds-clean"), not the tree and the variant"
grep -qE "^  base +mean 2\.000" "$ab" || fail "clean tree: no base row at 2.000: $(cat "$ab")"
grep -qE "^  v +mean 1\.500 .*-500\.0 us" "$ab" || fail "clean tree: no variant row 500 us below the base: $(cat "$ab")"
! grep -qE "^  this " "$ab" || fail "clean tree: a row for this tree beside the base: $(cat "$ab")"
[[ ! -e "$repo/kernels/marker" ]] || fail "the variant's file stayed in the tree"
# The second line: the tree's fingerprint, as variants.sh's tree_fingerprint gives it run in the tree.
fingerprint() { (cd "$repo" && source scripts/gpu/variants.sh && tree_fingerprint); }
clean_print=$(fingerprint)
[[ "$clean_print" =~ ^[0-9a-f]{12}$ ]] || fail "tree_fingerprint gives '$clean_print', not 12 hex digits"
[[ "$(sed -n 2p "$ab")" == "==> tree: $clean_print "* ]] || fail "the tree's fingerprint is not the second line: $(head -3 "$ab")"

mkdir -p "$repo/scripts/gpu/candidates" && echo "diff" > "$repo/scripts/gpu/candidates/next.patch"
echo "more figures" >> "$repo/docs/BENCHMARKS.md"
run unbuilt || fail "a candidate patch and a doc changed: exit $?: $(cat "$TMP/log-unbuilt")"
grep -q "this tree as it stands: built once" "$TMP/out-unbuilt/ab.txt" ||
  fail "a candidate patch and a doc changed, not built once: $(cat "$TMP/out-unbuilt/ab.txt")"
[[ $(wc -l < "$TMP/builds-unbuilt") == 2 ]] || fail "a candidate patch and a doc changed: builds $(cat "$TMP/builds-unbuilt")"
grep -q "^==> tree: $clean_print " "$TMP/out-unbuilt/ab.txt" ||
  fail "a candidate patch and a doc changed the fingerprint, though no build reads them: $(cat "$TMP/out-unbuilt/ab.txt")"
rm -r "$repo/scripts/gpu/candidates" && (cd "$repo" && git checkout -q docs/BENCHMARKS.md)

touch "$repo/untracked.txt"
run dirty || fail "untracked file: exit $?: $(cat "$TMP/log-dirty")"
ab="$TMP/out-dirty/ab.txt"
[[ $(wc -l < "$TMP/builds-dirty") == 3 ]] || fail "untracked file: builds $(cat "$TMP/builds-dirty"), not base, this and the variant"
grep -q "^$TMP/base-dirty\$" "$TMP/builds-dirty" || fail "untracked file: the base was not built in its own folder"
grep -q "with changes to 1 path(s): untracked.txt" "$ab" || fail "untracked file: the log does not name it: $(cat "$ab")"
dirty_print=$(fingerprint)
[[ "$dirty_print" != "$clean_print" ]] && grep -q "^==> tree: $dirty_print " "$ab" ||
  fail "untracked file: the fingerprint is the clean tree's ($clean_print) or not logged: $(cat "$ab")"
echo "a line" > "$repo/untracked.txt"
[[ "$(fingerprint)" != "$dirty_print" ]] || fail "untracked file: new bytes left the fingerprint as it was"
: > "$repo/untracked.txt"
grep -qE "^  this +mean 2\.000" "$ab" || fail "untracked file: no row for this tree: $(cat "$ab")"
# This tree's own change (a marker of 1.8, untracked): the variant (1.5, laid over it) 500 us below the
# base, and in the second summary 300 us below this tree.
echo 1.8 > "$repo/kernels/marker"
run changed || fail "a changed tree: exit $?: $(cat "$TMP/log-changed")"
ab="$TMP/out-changed/ab.txt"
grep -qE "^  v +mean 1\.500 .*-500\.0 us" "$ab" || fail "a changed tree: the variant not 500 us below the base: $(cat "$ab")"
against=$(sed -n '/the variants against this tree/,$p' "$ab")
grep -qE "^  this +mean 1\.800" <<< "$against" || fail "a changed tree: no summary against this tree: $(cat "$ab")"
grep -qE "^  v +mean 1\.500 .*-300\.0 us" <<< "$against" || fail "a changed tree: the variant not 300 us below this tree: $(cat "$ab")"
! grep -qE "^  base " <<< "$against" || fail "a changed tree: the base in the summary against this tree: $(cat "$ab")"
# --base-tree: the same changed tree is the base, built once, and the variant is timed against it.
run base-tree --base-tree || fail "--base-tree: exit $?: $(cat "$TMP/log-base-tree")"
ab="$TMP/out-base-tree/ab.txt"
[[ $(wc -l < "$TMP/builds-base-tree") == 2 ]] || fail "--base-tree: builds $(cat "$TMP/builds-base-tree"), not the tree and the variant"
grep -q "this tree as it stands (--base-tree" "$ab" || fail "--base-tree: the log does not say so: $(cat "$ab")"
grep -qE "^  base +mean 1\.800" "$ab" || fail "--base-tree: the base is not this tree: $(cat "$ab")"
grep -qE "^  v +mean 1\.500 .*-300\.0 us" "$ab" || fail "--base-tree: the variant not 300 us below this tree: $(cat "$ab")"
! grep -qE "^  this " "$ab" || fail "--base-tree: a row for this tree beside the base: $(cat "$ab")"
rm "$repo/kernels/marker"
! grep -q "the variants against this tree" "$TMP/out-clean/ab.txt" || fail "clean tree: a summary against this tree, which is the base"

rc=0
AB_TEST_FAIL="$TMP/base-failing-base" run failing-base || rc=$?
[[ $rc == 1 ]] || fail "a failing base build: exit $rc, not 1"
grep -q "base exit 3, this tree exit 0" "$TMP/out-failing-base/ab.txt" ||
  fail "a failing base build is not logged: $(cat "$TMP/out-failing-base/ab.txt")"
rm "$repo/untracked.txt"

rc=0
AB_TEST_FAIL="$repo" run failing || rc=$?
[[ $rc == 1 ]] || fail "a failing build: exit $rc, not 1"
grep -q "this tree exit 3" "$TMP/out-failing/ab.txt" || fail "a failing build is not logged: $(cat "$TMP/out-failing/ab.txt")"
run tests --tests || fail "--tests: exit $?: $(cat "$TMP/log-tests")"
ab="$TMP/out-tests/ab.txt"
for side in base v; do
  grep -q "^==> $side, gpu_test_cuda_hybrid: exit 0, \[  PASSED  \] 1 test." "$ab" || fail "--tests: no passing tests for $side: $(cat "$ab")"
done
grep -q "marker 2.0" "$TMP/out-tests/gpu_test_cuda_gdn-base.log" || fail "--tests: the base's tests are not the base's build"
grep -q "marker 1.5" "$TMP/out-tests/gpu_test_cuda_gdn-v.log" || fail "--tests: the variant's tests are not its build"
bench_line=$(grep -n "bench, v, run 1" "$ab" | cut -d: -f1) test_line=$(grep -n "base, gpu_test_cuda_gdn" "$ab" | cut -d: -f1)
((bench_line < test_line)) || fail "--tests: the tests ran before the benches: $(cat "$ab")"
run tests-variants --tests-variants || fail "--tests-variants: exit $?: $(cat "$TMP/log-tests-variants")"
ab="$TMP/out-tests-variants/ab.txt"
grep -q "^==> v, gpu_test_cuda_gdn: exit 0" "$ab" || fail "--tests-variants: the variant's tests did not run: $(cat "$ab")"
! grep -q "^==> base, gpu_test" "$ab" || fail "--tests-variants: this tree's tests ran: $(cat "$ab")"
touch "$TMP/v/kernels/failtest"
rc=0
run failing-test --tests || rc=$?
[[ $rc != 0 ]] || fail "a failing variant test: exit 0"
grep -qE "^  v +mean 1\.500" "$TMP/out-failing-test/ab.txt" || fail "a failing variant test: no figures: $(cat "$TMP/out-failing-test/ab.txt")"
grep -q "v, gpu_test_cuda_gdn: exit 1" "$TMP/out-failing-test/ab.txt" || fail "a failing variant test is not logged"
rm "$TMP/v/kernels/failtest"
# The variant's object left in the build folder, then this tree's marker given back its own older time (a
# copy of the tree that keeps files' times): the next run touches the marker before it builds, so that its
# base is this tree's 1.8 and not the variant's 1.5 (make alone would keep the variant's newer object).
echo 1.8 > "$repo/kernels/marker"
(cd "$repo" && git add kernels/marker && git -c user.name=t -c user.email=t@t commit -qm marker)
run stale-1 || fail "a committed marker: exit $?: $(cat "$TMP/log-stale-1")"
grep -qE "^  base +mean 1\.800" "$TMP/out-stale-1/ab.txt" || fail "a committed marker: the base is not 1.8: $(cat "$TMP/out-stale-1/ab.txt")"
touch -d '2020-01-01' "$repo/kernels/marker"
run stale-2 || fail "a marker with its old time: exit $?: $(cat "$TMP/log-stale-2")"
ab="$TMP/out-stale-2/ab.txt"
grep -qE "^  base +mean 1\.800" "$ab" || fail "a marker with its old time: the base is the variant's build: $(cat "$ab")"
grep -qE "^  v +mean 1\.500" "$ab" || fail "a marker with its old time: no variant at 1.5: $(cat "$ab")"
grep -q "1 file(s) an earlier variant had replaced hold other bytes now, touched so that they compile again: kernels/marker" "$ab" ||
  fail "a marker with its old time: the touch is not logged: $(cat "$ab")"
# --budget: the first round always runs; another is not started where it would end past the budget (two
# builds at 2 s a run: a round takes 4 s or more, so after one the budget of 4 s is spent), and
# the traces and tests are not run once the budget is spent. The figures of the round that ran stay; the exit is 1.
export AB_TEST_BENCH_SLEEP=2
rc=0
run budget --runs 3 --budget 4 --tests --trace || rc=$?
unset AB_TEST_BENCH_SLEEP
ab="$TMP/out-budget/ab.txt"
[[ $rc == 1 ]] || fail "--budget cut the run: exit $rc, not 1: $(cat "$TMP/log-budget")"
grep -q "^==> budget: 1 of 3 rounds (another would end past 4 s" "$ab" || fail "--budget: the cut is not logged: $(cat "$ab")"
! grep -q "bench, base, run 2" "$ab" || fail "--budget: a second round ran: $(cat "$ab")"
grep -qE "^  v +mean 1\.500" "$ab" || fail "--budget: the first round's figures are gone: $(cat "$ab")"
grep -q "^==> v, gpu_test_cuda_hybrid: not run (the budget is spent)" "$ab" || fail "--budget: tests ran past it: $(cat "$ab")"
grep -q "^==> trace, base: not run (the budget is spent)" "$ab" && ! grep -q "^==> trace, v (" "$ab" ||
  fail "--budget: a trace ran past it: $(cat "$ab")"
# A budget the run stays within changes nothing: every round and test, exit 0.
run budget-wide --runs 2 --budget 100000 --tests || fail "--budget not reached: exit $?: $(cat "$TMP/log-budget-wide")"
ab="$TMP/out-budget-wide/ab.txt"
grep -q "bench, v, run 2" "$ab" && ! grep -q "budget:" "$ab" && grep -q "^==> v, gpu_test_cuda_hybrid: exit 0" "$ab" ||
  fail "--budget not reached: $(cat "$ab")"
[[ "$(run bad-budget --budget 5s; echo $?)" == 2 ]] || fail "--budget 5s is not refused"
echo "ab-bench builds: ok"
