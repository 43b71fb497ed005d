#!/usr/bin/env bash
# scripts/gpu/ab_summary.py on hand-made `bench gdn --json` runs whose figures are known: each build's
# default-path figures (the row's and the default side of each alternation), their mean, the difference
# from the first build and whether the two builds' runs overlap; shapes that not every run has are left
# out; each build's windows and host times run by run, where its runs keep them; a run without a JSON line,
# or without the bench's keys, is refused by name; and two real CPU runs of `hydrahead bench gdn --json`
# read as the bench wrote them.
source "$(dirname "$0")/preamble.sh"

# One run: the bench's text lines, then its JSON line (only the keys ab_summary reads, and one it must
# not: the path alternated against, in blocks of 32 columns).
run() {  # FILE F+B DIRECT HEAD WGMMA CHUNK [extra shape row]
  cat > "$1" <<EOF
gated delta rule, H=16 Dk=Dv=128 ...
  1 x 32768  (table line)
{"device": "cuda", "rows": [{"B": 1, "T": 32768, "fwd_b2b_ms": 0.5, "fwd_bwd_b2b_ms": $2,
 "fwd_bwd_direct_in_scan_b2b_ms": $3, "fwd_bwd_direct_apart_b2b_ms": 9.0, "fwd_bwd_scan_head_b2b_ms": $4,
 "fwd_bwd_scan_column_blocks_b2b_ms": 9.0, "fwd_bwd_scan_wgmma_b2b_ms": $5, "fwd_bwd_scan_mma_sync_b2b_ms": 9.0,
 "fwd_bwd_backward_block_a_chunk_b2b_ms": $6, "fwd_bwd_backward_in_turn_b2b_ms": 9.0}${7:-}]}
EOF
  # The JSON object on one line, as the bench prints it.
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); i=t.index("{"); open(sys.argv[1],"w").write(t[:i]+json.dumps(json.loads(t[i:]))+"\n")' "$1"
}
# Base: 2.1 and 2.3 -> figures 2.10 2.12 2.14 2.16 2.18 and 2.30 2.30 2.30 2.30 2.30, mean 2.22.
run "$TMP/a1.json" 2.10 2.12 2.14 2.16 2.18 ', {"B": 4, "T": 8192, "fwd_bwd_b2b_ms": 1.0}'
run "$TMP/a2.json" 2.30 2.30 2.30 2.30 2.30
# The other build: every figure 2.00 (all below the base's), mean 2.00: -220.0 us, -9.9 %.
run "$TMP/b1.json" 2.00 2.00 2.00 2.00 2.00
run "$TMP/b2.json" 2.00 2.00 2.00 2.00 2.00
# A third: 2.20 and 2.24 (overlapping the base's), mean 2.22: +0.0 us.
run "$TMP/c1.json" 2.20 2.20 2.20 2.20 2.20
run "$TMP/c2.json" 2.24 2.24 2.24 2.24 2.24

out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "base=$TMP/a1.json,$TMP/a2.json" "new=$TMP/b1.json,$TMP/b2.json" \
  "mid=$TMP/c1.json,$TMP/c2.json")
# B4 T8K is in one run only: left out.
[[ "$(grep -c 'back to back' <<<"$out")" == 1 ]] || fail "shapes: $out"
grep -q "^1 x 32768, forward + backward, back to back (ms):$" <<<"$out" || fail "header: $out"
grep -qF "  base  mean 2.220  [2.100, 2.120, 2.140, 2.160, 2.180, 2.300, 2.300, 2.300, 2.300, 2.300]" <<<"$out" ||
  fail "base: $out"
grep -qE "^  new   mean 2\.000  \[(2\.000, ){9}2\.000\]  -220\.0 us \(-9\.9 %\), all below$" <<<"$out" || fail "new: $out"
grep -qE "^  mid   mean 2\.220  \[.*\]  [+-]0\.0 us \([+-]0\.0 %\)$" <<<"$out" || fail "mid: $out"
# Each build's runs paired in order with the base's: run means 2.14 and 2.30 against 2.00 and 2.00, so
# differences -140 and -300 us, mean -220; their standard deviation 113.137 us over two pairs, t(1) = 12.706:
# half-width 12.706 x 113.137 / sqrt(2) = 1016.5 us.
grep -qxF "    by run: -140.0, -300.0 us; mean -220.0 us, 95 % interval [-1236.5, +796.5] us (2 pairs)" <<<"$out" ||
  fail "new, by run: $out"
[[ "$(grep -c '    by run:' <<<"$out")" == 2 ]] || fail "a paired line for each build after the base: $out"
# Each figure alone, paired by run: the row's own figure 2.10, 2.30 against 2.00, 2.00, so -100 and -300 us,
# mean -200, standard deviation 141.421, half-width 12.706 x 141.421 / sqrt(2) = 1270.6 us; chunk_backward's
# default side 2.18, 2.30 against 2.00: -180 and -300, mean -240, standard deviation 84.853, half-width 762.4.
[[ "$(grep -c '    by figure, paired by run:' <<<"$out")" == 2 ]] || fail "a by-figure block for each build after the base: $out"
grep -qE "^      fwd_bwd_b2b_ms +-200\.0 us, \[-1470\.6, \+1070\.6\]$" <<<"$out" || fail "new, the row's own figure: $out"
grep -qE "^      fwd_bwd_backward_block_a_chunk_b2b_ms +-240\.0 us, \[-1002\.4, \+522\.4\]$" <<<"$out" ||
  fail "new, chunk_backward's figure: $out"
[[ "$(sed -n '/^  new /,/^  mid /p' <<<"$out" | grep -cE '^      fwd_bwd_')" == 5 ]] || fail "new: five figures: $out"
# A figure missing from one run (the third build's second run lacks the direct term's) is left out, the others kept.
python3 -c 'import json,sys; t=open(sys.argv[1]).read(); i=t.index("{"); o=json.loads(t[i:]); del o["rows"][0]["fwd_bwd_direct_in_scan_b2b_ms"]; open(sys.argv[2],"w").write(t[:i]+json.dumps(o)+"\n")' "$TMP/c2.json" "$TMP/c2-less.json"
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "base=$TMP/a1.json,$TMP/a2.json" "mid=$TMP/c1.json,$TMP/c2-less.json")
grep -qE "^      fwd_bwd_scan_head_b2b_ms " <<<"$out" || fail "mid, a figure every run has: $out"
if grep -qE "^      fwd_bwd_direct_in_scan_b2b_ms " <<<"$out"; then fail "mid, a figure one run lacks: $out"; fi

# Three runs a build: differences -10, -20, -30 us (mean -20, standard deviation 10), t(2) = 4.303: half-width
# 4.303 x 10 / sqrt(3) = 24.84 us.
for pair in 1:2.10:2.09 2:2.20:2.18 3:2.30:2.27; do
  IFS=: read -r i v w <<<"$pair"
  run "$TMP/p$i.json" "$v" "$v" "$v" "$v" "$v"
  run "$TMP/q$i.json" "$w" "$w" "$w" "$w" "$w"
done
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/p1.json,$TMP/p2.json,$TMP/p3.json" "b=$TMP/q1.json,$TMP/q2.json,$TMP/q3.json")
grep -qxF "    by run: -10.0, -20.0, -30.0 us; mean -20.0 us, 95 % interval [-44.8, +4.8] us (3 pairs)" <<<"$out" ||
  fail "three pairs: $out"
# One run each: the difference alone, no interval; runs that differ in number are not paired.
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/p1.json" "b=$TMP/q1.json" "c=$TMP/q1.json,$TMP/q2.json")
grep -qxF "    by run: -10.0 us; mean -10.0 us" <<<"$out" || fail "one pair: $out"
grep -qxF "    by run: not paired (2 runs against the base's 1)" <<<"$out" || fail "unequal runs: $out"
# One pair: each figure's difference, no interval; the unequal build has no by-figure block.
grep -qE "^      fwd_bwd_scan_wgmma_b2b_ms +-10\.0 us$" <<<"$out" || fail "one pair, by figure: $out"
[[ "$(grep -c '    by figure, paired by run:' <<<"$out")" == 1 ]] || fail "no by-figure block for unequal runs: $out"

# The forward's figures: 0.5 in every run.
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1.json" "b=$TMP/b1.json" --key fwd)
grep -qE "^  b  mean 0\.500  \[0\.500\]  \+0\.0 us \(\+0\.0 %\)$" <<<"$out" || fail "forward: $out"
# A single figure a run: no by-figure block (the paired line says it all).
if grep -q "by figure" <<<"$out"; then fail "forward, one figure: $out"; fi

# The default sides beside U and Qd/kdecay from chunk_factors count among the figures: base 2.10 (U's side)
# and 2.30 (Qd/kdecay's) added to a1's five, new 1.90 and 2.00 to b1's. Base mean (2.10 + 2.12 + 2.14 + 2.16 +
# 2.18 + 2.10 + 2.30) / 7 = 2.1571, new (5 x 2.00 + 1.90 + 2.00) / 7 = 1.9857: -171.4 us; by figure U's side
# -200.0 us, Qd/kdecay's -300.0 us.
for f in a1:2.10:2.30 b1:1.90:2.00; do
  IFS=: read -r name u qk <<<"$f"
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); i=t.index("{"); o=json.loads(t[i:]); o["rows"][0].update(fwd_bwd_u_in_scan_b2b_ms=float(sys.argv[3]), fwd_bwd_qk_in_scan_b2b_ms=float(sys.argv[4])); open(sys.argv[2],"w").write(t[:i]+json.dumps(o)+"\n")' \
    "$TMP/$name.json" "$TMP/$name-uqk.json" "$u" "$qk"
done
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1-uqk.json" "b=$TMP/b1-uqk.json")
grep -qE "^  a  mean 2\.157  \[2\.100, 2\.120, 2\.140, 2\.160, 2\.100, 2\.300, 2\.180\]$" <<<"$out" || fail "U and Qd/kdecay sides, base: $out"
grep -qE "^  b  mean 1\.986  \[.*\]  -171\.4 us \(-7\.9 %\), all below$" <<<"$out" || fail "U and Qd/kdecay sides, new: $out"
grep -qE "^      fwd_bwd_u_in_scan_b2b_ms +-200\.0 us$" <<<"$out" && grep -qE "^      fwd_bwd_qk_in_scan_b2b_ms +-300\.0 us$" <<<"$out" ||
  fail "U and Qd/kdecay sides, by figure: $out"

# The row's windows, run by run, and the host's time to queue a run in each, where every run keeps them:
# a1 and a2 with windows and host times, b1 with windows only, b2 with neither.
addw() {  # IN OUT WINDOWS [HOST]: IN's row at 1 x 32768 with fwd_bwd_b2b_windows_ms (and host) set
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); i=t.index("{"); o=json.loads(t[i:]); r=o["rows"][0]; r["fwd_bwd_b2b_windows_ms"]=json.loads(sys.argv[3]); sys.argv[4:] and r.update(fwd_bwd_b2b_host_windows_ms=json.loads(sys.argv[4])); open(sys.argv[2],"w").write(t[:i]+json.dumps(o)+"\n")' "$@"
}
addw "$TMP/a1.json" "$TMP/a1-w.json" "[2.1, 2.1234, 2.2]" "[0.25, 0.3, 0.31]"
addw "$TMP/a2.json" "$TMP/a2-w.json" "[2.3, 2.31, 2.29]" "[0.2, 0.21, 0.22]"
addw "$TMP/b1.json" "$TMP/b1-w.json" "[2.0, 2.01, 1.99]"
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1-w.json,$TMP/a2-w.json" "b=$TMP/b1-w.json,$TMP/b1-w.json" \
  "c=$TMP/b1-w.json,$TMP/b2.json")
grep -qxF "    windows by run: 2.100 2.123 2.200 | 2.300 2.310 2.290; host a run: 0.250 0.300 0.310 | 0.200 0.210 0.220" <<<"$out" ||
  fail "windows and host times: $out"
grep -qxF "    windows by run: 2.000 2.010 1.990 | 2.000 2.010 1.990" <<<"$out" || fail "windows without host times: $out"
[[ "$(grep -c '    windows by run:' <<<"$out")" == 2 ]] || fail "no windows line where a run lacks them: $out"
# Under its own build: a's line right after a's figures, b's after b's paired lines.
[[ "$(sed -n 3p <<<"$out")" == "    windows by run: 2.100"* ]] || fail "a's windows under a: $out"
# The forward's key takes the forward's windows, which these runs do not keep.
if python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1-w.json" "b=$TMP/b1-w.json" --key fwd | grep -q "windows by run"; then
  fail "forward: windows of forward + backward"
fi

# A run that is not the bench's JSON output.
echo "no json here" > "$TMP/bad.txt"
if err=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1.json" "b=$TMP/bad.txt" 2>&1); then fail "accepted $TMP/bad.txt"; fi
grep -qF "no JSON line in $TMP/bad.txt" <<<"$err" || fail "refusal: $err"
# Runs without the row's own figure (keys the bench does not write) are refused, not averaged over nothing.
echo '{"rows": [{"B": 1, "T": 32768, "fwd_bwd_ms": 2.0}]}' > "$TMP/nokeys.json"
if err=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/a1.json" "b=$TMP/nokeys.json" 2>&1); then fail "accepted runs without b2b figures"; fi
grep -qF "b's runs lack fwd_bwd_b2b_ms at 1 x 32768" <<<"$err" || fail "refusal of missing keys: $err"

# The keys are the bench's own: two real (CPU, tiny) runs of `hydrahead bench gdn --json`, each build's one
# figure its row's fwd_bwd_b2b_ms.
for side in a b; do
  "$HH_BIN_DIR/hydrahead" bench gdn --device cpu --shapes 1x128 --iters 1 --warmup 0 --heads 2 --dim 32 --json > "$TMP/real-$side.txt"
done
out=$(python3 "$ROOT/scripts/gpu/ab_summary.py" "a=$TMP/real-a.txt" "b=$TMP/real-b.txt")
for side in a b; do
  want=$(python3 -c 'import json,sys; l=[x for x in open(sys.argv[1]) if x.startswith("{")][0]; print("%.3f" % json.loads(l)["rows"][0]["fwd_bwd_b2b_ms"])' "$TMP/real-$side.txt")
  grep -qE "^  $side  mean $want  \[$want\]" <<<"$out" || fail "real run $side (want $want): $out"
done
# and the bench's own windows: three a run, each with the host's time beside it.
[[ "$(grep -cE '^    windows by run: [0-9.]+ [0-9.]+ [0-9.]+; host a run: [0-9.]+ [0-9.]+ [0-9.]+$' <<<"$out")" == 2 ]] ||
  fail "real runs' windows: $out"
echo "ab_summary: ok"
