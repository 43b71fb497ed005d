#!/usr/bin/env bash
# scripts/gpu/candidate-tests in a scratch repository whose scripts/gpu-check is a stand-in (the real one
# needs nvcc and a CUDA LibTorch): each build records the tree it saw (kernels/k.cu and kernels/marker) and
# leaves test binaries that print their arguments and pass, or fail where the marker says so. A folder
# and a patch are built in turn over the tree, each with its own files, and the tree is as before after
# them; --filter reaches every test binary; a failing test or build makes the exit 1 and the other
# candidates still run; bad arguments (a name given twice among them) exit 2. Each candidate's files are
# recorded in build-gpu/overlaid.sha1, so that the next build of the tree compiles them again.
source "$(dirname "$0")/preamble.sh"
repo="$TMP/repo"
mkdir -p "$repo/scripts/gpu" "$repo/kernels"
cp "$ROOT/scripts/gpu/candidate-tests" "$ROOT/scripts/gpu/gpu_tests.sh" "$ROOT/scripts/gpu/tree-overlay" "$repo/scripts/gpu/"
cat > "$repo/scripts/gpu-check" <<'STUB'
#!/usr/bin/env bash
marker=$(cat kernels/marker 2>/dev/null || echo none)
echo "$marker $(tr '\n' ' ' < kernels/k.cu)" >> "$CT_TEST_BUILDS"
[[ "$marker" != buildfail ]] || { echo "stand-in: the build failed"; exit 3; }
mkdir -p build-gpu/tests
for t in gpu_test_cuda_gdn gpu_test_cuda_train gpu_test_cuda_hybrid; do
  if [[ "$marker" == testfail && "$t" == gpu_test_cuda_train ]]; then
    printf '#!/usr/bin/env bash\necho "args: $*"\necho "[  FAILED  ] 1 test, listed below:"\necho "x.cpp:1: Failure"\nexit 1\n' > build-gpu/tests/$t
  else
    printf '#!/usr/bin/env bash\necho "args: $*"\necho "[  PASSED  ] 1 test."\n' > build-gpu/tests/$t
  fi
  chmod +x build-gpu/tests/$t
done
STUB
commit_scratch_repo "$repo"
# A candidate as a folder (a new file) and one as a patch (a changed line).
mkdir -p "$TMP/a/kernels" && echo a > "$TMP/a/kernels/marker"
(cd "$repo" && echo "kernel, patched" > kernels/k.cu && git diff > "$TMP/p.patch" && git checkout -q kernels/k.cu)

run() {  # NAME ARGS...: candidate-tests in the scratch repository; its exit status
  local name=$1; shift
  export CT_TEST_BUILDS="$TMP/builds-$name"
  : > "$CT_TEST_BUILDS"
  (cd "$repo" && OUT="$TMP/out-$name" ./scripts/gpu/candidate-tests "$@" > "$TMP/log-$name" 2>&1)
}
unchanged() {  # NAME: the tree as committed after the run
  [[ -z "$(cd "$repo" && git status --porcelain)" ]] || fail "$1: the tree changed: $(cd "$repo" && git status --porcelain)"
}

run two --filter 'CudaGdn.*' "a=$TMP/a" "p=$TMP/p.patch" || fail "two candidates: exit $?: $(cat "$TMP/log-two")"
[[ "$(cat "$TMP/builds-two")" == $'a kernel \nnone kernel, patched ' ]] ||
  fail "two candidates: the builds saw $(cat "$TMP/builds-two"), not a's marker and then the patched k.cu alone"
summary="$TMP/out-two/tests.txt"
for c in a p; do
  for t in gpu_test_cuda_gdn gpu_test_cuda_train gpu_test_cuda_hybrid; do
    grep -qF "==> $c, $t: exit 0, [  PASSED  ] 1 test." "$summary" || fail "two candidates: no passing line for $c, $t: $(cat "$summary")"
    grep -qx "args: --gtest_filter=CudaGdn.\*" "$TMP/out-two/$t-$c.log" || fail "two candidates: $t of $c without the filter"
  done
done
grep -qF "==> a: this tree with kernels/marker" "$summary" || fail "two candidates: a's files not named: $(cat "$summary")"
grep -qF "==> p: this tree with kernels/k.cu" "$summary" || fail "two candidates: p's files not named: $(cat "$summary")"
grep -qF "==> candidate-tests: exit 0" "$summary" || fail "two candidates: no exit line"
unchanged "two candidates"
# Each candidate's files are recorded for the next build of the tree (scripts/gpu/tree-overlay refresh).
for f in kernels/marker kernels/k.cu; do
  grep -qE "^[0-9a-f]{40}  $f\$" "$repo/build-gpu/overlaid.sha1" || fail "two candidates: $f not recorded: $(cat "$repo/build-gpu/overlaid.sha1")"
done

# Without --filter the binaries get no argument.
run plain "p=$TMP/p.patch" || fail "no filter: exit $?"
grep -qx "args: " "$TMP/out-plain/gpu_test_cuda_gdn-p.log" || fail "no filter: $(cat "$TMP/out-plain/gpu_test_cuda_gdn-p.log")"

# A failing test: exit 1 with its failure shown, and the next candidate still built and tested.
mkdir -p "$TMP/t/kernels" && echo testfail > "$TMP/t/kernels/marker"
run testfail "t=$TMP/t" "a=$TMP/a" && fail "a failing test: exit 0"
grep -qF "==> t, gpu_test_cuda_train: exit 1, [  FAILED  ] 1 test, listed below:" "$TMP/out-testfail/tests.txt" ||
  fail "a failing test: no failing line: $(cat "$TMP/out-testfail/tests.txt")"
grep -qF "x.cpp:1: Failure" "$TMP/log-testfail" || fail "a failing test: its failure not shown"
grep -qF "==> a, gpu_test_cuda_hybrid: exit 0" "$TMP/out-testfail/tests.txt" || fail "a failing test: the next candidate did not run"
unchanged "a failing test"

# A failing build: exit 1 with its log's tail, no tests of it, the next candidate still built.
mkdir -p "$TMP/b/kernels" && echo buildfail > "$TMP/b/kernels/marker"
run buildfail "b=$TMP/b" "a=$TMP/a" && fail "a failing build: exit 0"
grep -qF "==> b: build" "$TMP/out-buildfail/tests.txt" && grep -qF "exit 3" "$TMP/out-buildfail/tests.txt" ||
  fail "a failing build: no build line with its exit: $(cat "$TMP/out-buildfail/tests.txt")"
grep -qF "stand-in: the build failed" "$TMP/log-buildfail" || fail "a failing build: its log not shown"
! grep -qF "==> b, gpu_test" "$TMP/out-buildfail/tests.txt" || fail "a failing build: its tests ran"
[[ $(wc -l < "$TMP/builds-buildfail") == 2 ]] || fail "a failing build: the next candidate was not built"
unchanged "a failing build"

# A patch that does not apply: named, exit 1, the tree untouched.
printf 'diff --git a/kernels/k.cu b/kernels/k.cu\n--- a/kernels/k.cu\n+++ b/kernels/k.cu\n@@ -1 +1 @@\n-no such line\n+x\n' > "$TMP/bad.patch"
run badpatch "x=$TMP/bad.patch" && fail "a patch that does not apply: exit 0"
grep -qF "==> x: $TMP/bad.patch does not apply to this tree" "$TMP/out-badpatch/tests.txt" ||
  fail "a patch that does not apply: $(cat "$TMP/out-badpatch/tests.txt")"
[[ ! -s "$TMP/builds-badpatch" ]] || fail "a patch that does not apply: built"
unchanged "a patch that does not apply"

# Bad arguments: exit 2 with the reason, nothing built.
refused() {  # MESSAGE ARGS...
  local want=$1; shift
  local r=0
  run refused "$@" || r=$?
  ((r == 2)) || fail "'$*': exit $r, not 2"
  grep -qF "$want" "$TMP/log-refused" || fail "'$*': no '$want' in $(cat "$TMP/log-refused")"
  [[ ! -s "$TMP/builds-refused" ]] || fail "'$*': built"
}
refused "no candidate given"
refused "'a' is not NAME=PATCH or NAME=DIR" a
refused "nothing: $TMP/none does not exist" "nothing=$TMP/none"
refused "unknown option --runs" --runs 2 "a=$TMP/a"
refused "a is given twice" "a=$TMP/a" "a=$TMP/p.patch"
echo "candidate-tests: ok"
