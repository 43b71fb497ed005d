#!/usr/bin/env bash
# scripts/gpu/trace_summary.py on a hand-made Chrome trace whose sums are known: kernel time by name
# (busy time, span, shares), the host's side (operators, the first and last kernel, runtime calls by
# total time) and --by-scope (each kernel charged to the innermost hh:: range open at its launch).
source "$(dirname "$0")/preamble.sh"

# Times in microseconds. Thread 1 opens hh::gdn::forward at 1000 for 5000 and, inside it,
# hh::gdn::scan at 1250 for 100; it launches kA (correlation 1, at 1100), kB (2, at 1200) and kA
# again (3, at 1300, inside the scan range), then waits in cudaDeviceSynchronize for 2000. Kernel 4 has
# no launch on record.
cat > "$TMP/trace.json" <<'JSON'
{"traceEvents": [
  {"cat": "cpu_op", "name": "hh::gdn::forward", "ts": 1000, "dur": 5000, "tid": 1},
  {"cat": "user_annotation", "name": "hh::gdn::scan", "ts": 1250, "dur": 100, "tid": 1},
  {"cat": "cpu_op", "name": "aten::empty", "ts": 1050, "dur": 10, "tid": 1},
  {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1100, "dur": 10, "tid": 1, "args": {"correlation": 1}},
  {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1200, "dur": 20, "tid": 1, "args": {"correlation": 2}},
  {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1300, "dur": 5, "tid": 1, "args": {"correlation": 3}},
  {"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 1400, "dur": 2000, "tid": 1},
  {"cat": "kernel", "name": "kA", "ts": 2000, "dur": 300, "tid": 7, "args": {"correlation": 1}},
  {"cat": "kernel", "name": "kB", "ts": 2500, "dur": 200, "tid": 7, "args": {"correlation": 2}},
  {"cat": "kernel", "name": "kA", "ts": 3000, "dur": 100, "tid": 7, "args": {"correlation": 3}},
  {"cat": "kernel", "name": "kC", "ts": 3200, "dur": 400, "tid": 7, "args": {"correlation": 4}}
]}
JSON
out=$(python3 "$ROOT/scripts/gpu/trace_summary.py" "$TMP/trace.json")
# Busy 300 + 200 + 100 + 400 = 1000 us over 2000 .. 3600; kA 400 us (40 %), kC 400 (40 %), kB 200 (20 %).
grep -q "^kernels: 4, busy 1.0 ms over a span of 1.6 ms$" <<<"$out" || fail "totals: $out"
grep -qE "^ +0\.40 ms +40\.0% +2x  kA$" <<<"$out" || fail "kA: $out"
grep -qE "^ +0\.20 ms +20\.0% +1x  kB$" <<<"$out" || fail "kB: $out"
# Operators from 1000 to 6000; kernels from 2000 - 1000 to 3600 - 1000.
grep -q "^host: operators from 0 to 5.00 ms; kernels from 1.00 to 2.60 ms$" <<<"$out" || fail "host: $out"
grep -qE "^ +2\.00 ms +1x  longest 2\.00 ms  cudaDeviceSynchronize$" <<<"$out" || fail "sync: $out"
grep -qE "^ +0\.04 ms +3x  longest 0\.02 ms  cudaLaunchKernel$" <<<"$out" || fail "launches: $out"
# The sync, the longest call, is listed first.
[[ "$(grep -E 'longest' <<<"$out" | head -1)" == *cudaDeviceSynchronize ]] || fail "order of runtime calls: $out"

out=$(python3 "$ROOT/scripts/gpu/trace_summary.py" "$TMP/trace.json" --by-scope hh::)
# kA at 1100 and kB at 1200: forward only; kA at 1300: inside the scan too (the innermost); kC: no launch.
grep -q "^kernel time 1.0 ms by innermost hh::\* range$" <<<"$out" || fail "by scope total: $out"
grep -qE "^ +0\.50 ms +50\.0%  hh::gdn::forward$" <<<"$out" || fail "forward scope: $out"
grep -qE "^ +0\.10 ms +10\.0%  hh::gdn::scan$" <<<"$out" || fail "scan scope: $out"
grep -qE "^ +0\.40 ms +40\.0%  \(outside hh::\*\)$" <<<"$out" || fail "outside: $out"
# A reader that has gone (`| head` that has what it wants): the script ends quietly, with no traceback. The
# reader here exits before the script starts writing (the pipeline's status is the signal's, 141).
{ sleep 0.5; python3 "$ROOT/scripts/gpu/trace_summary.py" "$TMP/trace.json" 2>"$TMP/pipe.err"; } | true || :
[[ ! -s "$TMP/pipe.err" ]] || fail "closed pipe: $(cat "$TMP/pipe.err")"
echo "trace_summary: ok"
