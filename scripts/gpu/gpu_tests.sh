# Sourced by scripts/gpu/ab-bench and scripts/gpu/candidate-tests: the gated delta rule's GPU test binaries,
# and how one build's binaries of them are run and logged.
GPU_TESTS=(gpu_test_cuda_gdn gpu_test_cuda_train gpu_test_cuda_hybrid)
# run_gpu_tests DIR NAME [FILTER]: each of GPU_TESTS in DIR, run from the current folder with FILTER as its
# GoogleTest filter (default: all its tests), its output in $OUT/TEST-NAME.log; a line each through the
# caller's `log` (its exit, GoogleTest's PASSED / FAILED line), then the first failures. Returns 1 when
# any test binary failed. With GPU_TESTS_DEADLINE set (a value of the caller's SECONDS), each binary runs
# under `timeout` of the time left before it (exit 124 where it ran out), and none once it has passed.
run_gpu_tests() {
  local dir=$1 name=$2 filter=${3:-} t r failed=0 left within
  for t in "${GPU_TESTS[@]}"; do
    within=()  # with a deadline (the caller's SECONDS at which its budget ends): timeout of what is left
    if [[ -n "${GPU_TESTS_DEADLINE:-}" ]]; then
      left=$((GPU_TESTS_DEADLINE - SECONDS))
      if ((left <= 0)); then
        log "$name, $t: not run (the budget is spent)"
        failed=1
        continue
      fi
      within=(timeout "$left")
    fi
    "${within[@]}" "$dir/$t" ${filter:+"--gtest_filter=$filter"} > "$OUT/$t-$name.log" 2>&1
    r=$?
    ((${#within[@]} == 0 || r != 124)) || echo "[ timed out at the budget's end: ${left} s ]" >> "$OUT/$t-$name.log"
    ((r == 0)) || failed=1
    log "$name, $t: exit $r, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$OUT/$t-$name.log" | tr '\n' ' ')"
    grep -E "Failure" -A6 "$OUT/$t-$name.log" | head -30
  done
  return $failed
}
