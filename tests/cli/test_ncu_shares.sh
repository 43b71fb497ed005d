#!/usr/bin/env bash
# scripts/gpu/ncu_shares.py on Nsight Compute raw-page metric lines: chunk_backward's from a profile on an
# H100 (a subset of its metric lines as ncu printed them; the page's header and attribute lines above them
# are written here in their shape, lines the script must pass over) and a hand-made kernel in another time
# unit with no wgmma counter (a device before Hopper): the row's figures, the stalls' order and what it
# leaves out, and the errors that name the file. The row's figures for chunk_backward are the metric values
# rounded by hand (961.18 us -> 0.961 ms; 24.51, 18.54, 6.18 %; the four largest ratios other than
# selected / not_selected); its subset has no DRAM line, so that column reads '-'.
source "$(dirname "$0")/preamble.sh"

cat > "$TMP/backward.txt" <<'RAW'
[4711] hydrahead@127.0.0.1
  void hh::kernels::chunk_backward_kernel<128, 128, c10::BFloat16, 1, 1, 0>(...) (8192, 1, 1)x(512, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: Command line profiler metrics
    ---------------------------------------------------------------------- --------------- ------------
    Metric Name                                                                Metric Unit Metric Value
    ---------------------------------------------------------------------- --------------- ------------
    device__attribute_display_name                                                         NVIDIA H100 80GB HBM3
    device__attribute_limits_max_cta_per_sm                                      block                   32
  gpu__time_duration.sum                                                                                                   us               961.18
  launch__registers_per_thread                                                                                register/thread                  128
  sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active                                                    %                    0
  sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active                                                    %                 6.18
  sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active                                                            %                18.54
  sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active                                                    %                18.54
  sm__warps_active.avg.pct_of_peak_sustained_active                                                                         %                24.51
  smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                                                       inst                 1.29
  smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio                                               inst                 1.11
  smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio                                            inst                 0.57
  smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio                                                  inst                 1.06
  smsp__average_warps_issue_stalled_selected_per_issue_active.ratio                                                      inst                 1.00
  smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio                                              inst                 3.26
  smsp__average_warps_issue_stalled_wait_per_issue_active.ratio                                                          inst                 1.48
  smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio                                                      inst                  n/a
RAW

# Hand-made: 1,250 nanoseconds (a thousands separator), no wgmma counter, the tensor pipe only by its
# hmma name, DRAM by its older name (61.27 % -> 61.3 %); stalls 0.5 (wait) > 0.25 (barrier) > 0.125 (mio
# throttle), and selected's 1.0 left out.
cat > "$TMP/old.txt" <<'RAW'
  gpu__time_duration.sum                                    nsecond     1,250
  launch__registers_per_thread                      register/thread        40
  sm__warps_active.avg.pct_of_peak_sustained_active                %      50
  dram__throughput.avg.pct_of_peak_sustained_elapsed               %   61.27
  sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active  %  12.5
  sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active  %  3.26
  smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio  inst  0.13
  smsp__average_warps_issue_stalled_selected_per_issue_active.ratio      inst  1
  smsp__average_warps_issue_stalled_wait_per_issue_active.ratio          inst  0.5
  smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio       inst  0.25
RAW

out=$(python3 "$ROOT/scripts/gpu/ncu_shares.py" backward="$TMP/backward.txt" old="$TMP/old.txt")
[[ "$(sed -n 3p <<<"$out")" == "| backward | 0.961 ms | 128 | 24.5 % | - | 18.5 % | 6.2 % / 0.0 % | short scoreboard 3.26, wait 1.48, barrier 1.29, long scoreboard 1.11 |" ]] ||
  fail "chunk_backward's row: $out"
[[ "$(sed -n 4p <<<"$out")" == "| old | 0.001 ms | 40 | 50.0 % | 61.3 % | 12.5 % | 3.3 % / - | wait 0.50, barrier 0.25, mio throttle 0.13 |" ]] ||
  fail "the hand-made row: $out"
[[ "$(wc -l <<<"$out")" == 4 ]] || fail "a header, its rule and a row a file: $out"
grep -q "not selected\|| selected\|, selected" <<<"$out" && fail "a ready warp's reasons are not waits: $out"

# DRAM by its newer name reads the same.
sed 's/^  dram__throughput/  gpu__dram_throughput/' "$TMP/old.txt" > "$TMP/newer.txt"
out=$(python3 "$ROOT/scripts/gpu/ncu_shares.py" old="$TMP/newer.txt")
[[ "$(sed -n 3p <<<"$out")" == "| old | 0.001 ms | 40 | 50.0 % | 61.3 % |"* ]] || fail "DRAM by gpu__dram_throughput: $out"

out=$(python3 "$ROOT/scripts/gpu/ncu_shares.py" --stalls 1 b="$TMP/backward.txt")
[[ "$(sed -n 3p <<<"$out")" == *"| short scoreboard 3.26 |" ]] || fail "--stalls 1: $out"

# Errors: a metric missing (named with the file), two launches in one file, not LABEL=FILE, no such file.
grep -v warps_active "$TMP/old.txt" > "$TMP/nowarps.txt"
if python3 "$ROOT/scripts/gpu/ncu_shares.py" x="$TMP/nowarps.txt" > /dev/null 2> "$TMP/err.txt"; then
  fail "a file without the warps' metric was accepted"
fi
grep -q "^ncu_shares: $TMP/nowarps.txt: no sm__warps_active.avg.pct_of_peak_sustained_active" "$TMP/err.txt" ||
  fail "missing metric message: $(cat "$TMP/err.txt")"
cat "$TMP/old.txt" "$TMP/old.txt" > "$TMP/twice.txt"
if python3 "$ROOT/scripts/gpu/ncu_shares.py" x="$TMP/twice.txt" > /dev/null 2> "$TMP/err.txt"; then
  fail "a file with two launches was accepted"
fi
grep -q "appears twice: the file holds more than one launch" "$TMP/err.txt" || fail "two launches: $(cat "$TMP/err.txt")"
set +e
python3 "$ROOT/scripts/gpu/ncu_shares.py" "$TMP/old.txt" > /dev/null 2> "$TMP/err.txt"
rc=$?
python3 "$ROOT/scripts/gpu/ncu_shares.py" x="$TMP/none.txt" > /dev/null 2> "$TMP/err2.txt"
rc2=$?
set -e
[[ $rc == 2 ]] && grep -q "is not LABEL=FILE" "$TMP/err.txt" || fail "no label: exit $rc, $(cat "$TMP/err.txt")"
[[ $rc2 == 1 ]] && grep -q "none.txt" "$TMP/err2.txt" || fail "no such file: exit $rc2, $(cat "$TMP/err2.txt")"
echo "ok"
