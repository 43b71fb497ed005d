#!/usr/bin/env bash
# scripts/gpu/ncu_top.py --mix and scripts/gpu/ncu_lines.py on a hand-made Nsight Compute source table
# and nvdisasm listing whose sums are known: executed instructions by opcode, and executed instructions
# and stall samples by source line (innermost line outside the toolkit's headers, and the kernel's own),
# and one line's instructions (--show).
source "$(dirname "$0")/preamble.sh"

# Kernel k: four instructions. Executed 100, 300, 500, 100 (1000 in all); samples 10, 20, 60, 10 (100).
cat > "$TMP/source.csv" <<'CSV'
"Kernel Name","void k(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","L2 Theoretical Sectors Global Excessive"
"0x7f0000000000","      LDC R1, c[0x0][0x28]","10","5","100","1","0"
"0x7f0000000010","      FFMA R2, R3, R4, R2","20","5","300","2","30"
"0x7f0000000020","@P0   FFMA.FTZ R5, R3, R4, R5","60","30","500","50","10"
"0x7f0000000030","      EXIT","10","0","100","0","60"
CSV
# The listing: a second function first (not the kernel), then k. The LDC comes from the kernel's line 5;
# the first FFMA from helper.cuh line 12 inlined at k.cu line 7; the predicated FFMA from a toolkit
# header inlined at helper.cuh line 13 inlined at k.cu line 7; EXIT from line 9.
cat > "$TMP/k.sass" <<'SASS'
	.section	.text._Z5otherv,"ax",@progbits
.text._Z5otherv:
	//## File "/src/k.cu", line 2
        /*0000*/                   EXIT ;
	.section	.text._ZN2hh1kILi128EEEvPf,"ax",@progbits
.text._ZN2hh1kILi128EEEvPf:
	//## File "/src/k.cu", line 5
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/src/helper.cuh", line 12 inlined at "/src/k.cu", line 7
	//## File "/src/k.cu", line 7
        /*0010*/                   FFMA R2, R3, R4, R2 ;
	//## File "/usr/local/cuda/include/x.hpp", line 40 inlined at "/src/helper.cuh", line 13
	//## File "/src/helper.cuh", line 13 inlined at "/src/k.cu", line 7
	//## File "/src/k.cu", line 7
        /*0020*/              @P0  FFMA.FTZ R5, R3, R4, R5 ;
	//## File "/src/k.cu", line 9
        /*0030*/                   EXIT ;
SASS

out=$(python3 "$ROOT/scripts/gpu/ncu_top.py" "$TMP/source.csv" --mix)
grep -q "^1000 warp instructions executed; by opcode:$" <<<"$out" || fail "mix total: $out"
grep -qE "^ +80\.0% +800  FFMA$" <<<"$out" || fail "FFMA (predicate and modifiers dropped): $out"
grep -qE "^ +10\.0% +100  LDC$" <<<"$out" || fail "LDC: $out"

out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function 'regex:k<\(int\)128>')
grep -q "4 instructions, 1000 warp instructions executed, 100 samples" <<<"$out" || fail "totals: $out"
# --function is ncu's pattern, searched for in the name as ncu writes it (k<(int)128>; other): one naming both
# functions takes the one with the table's instruction count; one in the mangled form names none; a bad one is
# refused.
out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function '^(other|k<.*>)$')
grep -q "4 instructions, 1000 warp instructions executed, 100 samples" <<<"$out" || fail "a regular expression: $out"
for bad in 'kILi128E:no function matching' '(:not a regular expression'; do
  if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function "${bad%%:*}" > "$TMP/fn.txt" 2>&1; then
    fail "--function '${bad%%:*}' was accepted"
  fi
  grep -q "${bad#*:}" "$TMP/fn.txt" || fail "--function '${bad%%:*}': $(cat "$TMP/fn.txt")"
done
inner=$(sed -n '/by the line itself/,/by the outermost/p' <<<"$out")
outer=$(sed -n '/by the outermost/,$p' <<<"$out")
# Innermost: helper.cuh:13 (500, 60 %; the toolkit's header skipped), helper.cuh:12 (300), k.cu:5, k.cu:9.
grep -qE "^ +50\.0% +60\.0%  helper\.cuh:13 " <<<"$inner" || fail "helper.cuh:13: $inner"
grep -qE "^ +30\.0% +20\.0%  helper\.cuh:12 " <<<"$inner" || fail "helper.cuh:12: $inner"
grep -qE "^ +10\.0% +10\.0%  k\.cu:5 " <<<"$inner" || fail "k.cu:5: $inner"
# Outermost: both FFMAs on k.cu:7.
grep -qE "^ +80\.0% +80\.0%  k\.cu:7 " <<<"$outer" || fail "k.cu:7: $outer"
[[ "$(grep -cE '^ +[0-9.]+%' <<<"$outer")" == 3 ]] || fail "three kernel lines: $outer"

# --metric sums another column by line and orders by it: k.cu:9 (60 of 100), then k.cu:7 (40); by the
# innermost line helper.cuh:12 (30) comes before helper.cuh:13 (10).
out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --metric "sectors global excessive")
grep -q "100 samples, 100 L2 Theoretical Sectors Global Excessive$" <<<"$out" || fail "metric total: $out"
outer=$(sed -n '/by the outermost/,$p' <<<"$out")
inner=$(sed -n '/by the line itself/,/by the outermost/p' <<<"$out")
[[ "$(grep -E '^ +[0-9.]+%' <<<"$outer" | head -1)" =~ ^\ +10\.0%\ +10\.0%\ +60\.0%\ +60\ +k\.cu:9 ]] || fail "k.cu:9 first by the metric: $outer"
grep -qE "^ +80\.0% +80\.0% +40\.0% +40  k\.cu:7 " <<<"$outer" || fail "k.cu:7 by the metric: $outer"
[[ "$(grep -E 'helper' <<<"$inner" | head -1)" == *helper.cuh:12* ]] || fail "helper.cuh:12 before :13 by the metric: $inner"
if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --metric "no such" > "$TMP/nometric.txt" 2>&1; then
  fail "an unknown metric column was accepted"
fi
grep -q "no column named like 'no such'" "$TMP/nometric.txt" || fail "unknown metric message: $(cat "$TMP/nometric.txt")"

# --show lists one line's instructions: k.cu:7 (outermost) holds instructions 1 and 2; helper.cuh:13
# (innermost) only 2, with its executed count, samples and top stall reason.
out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --show k.cu:7)
[[ "$(wc -l <<<"$out")" == 2 ]] || fail "k.cu:7 has two instructions: $out"
out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --show helper.cuh:13)
grep -qE "^ +2 +500 +60  stall_barrier +@P0   FFMA.FTZ R5, R3, R4, R5$" <<<"$out" || fail "helper.cuh:13: $out"
if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --show k.cu:99 > /dev/null 2>&1; then
  fail "a line without instructions was accepted"
fi

# A listing whose instructions do not match the table stops with the instruction's index.
sed 's/FFMA R2, R3, R4, R2/FMUL R2, R3, R4/' "$TMP/k.sass" > "$TMP/bad.sass"
if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/bad.sass" --function k > "$TMP/bad.txt" 2>&1; then
  fail "a mismatched listing was accepted"
fi
grep -q "instruction 1: the table has 'FFMA R2, R3, R4, R2', the listing FMUL" "$TMP/bad.txt" || fail "mismatch message: $(cat "$TMP/bad.txt")"

# --reason lists the instructions by one stall reason's samples: stall_barrier has 53 of the 100; the
# predicated FFMA's 50 first (innermost helper.cuh:13, outermost k.cu:7), then 2 and 1; EXIT's 0 not at all.
out=$(python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --reason stall_barrier)
grep -q "^stall_barrier: 53 of 100 samples (53.0 %)$" <<<"$out" || fail "--reason total: $out"
[[ "$(sed -n 2p <<<"$out")" =~ ^\ +50\.0%\ +2\ +helper\.cuh:13\ +\<-\ k\.cu:7\ +@P0\ +FFMA\.FTZ\ R5,\ R3,\ R4,\ R5$ ]] ||
  fail "--reason first: $out"
[[ "$(sed -n 3p <<<"$out")" =~ ^\ +2\.0%\ +1\ +helper\.cuh:12\ +\<-\ k\.cu:7 ]] || fail "--reason second: $out"
[[ "$(sed -n 4p <<<"$out")" =~ ^\ +1\.0%\ +0\ +k\.cu:5\ +\<-\ k\.cu:5\ +LDC ]] || fail "--reason third: $out"
[[ "$(wc -l <<<"$out")" == 4 ]] || fail "--reason lists only instructions with samples: $out"
if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --reason stall_nope > "$TMP/noreason.txt" 2>&1; then
  fail "an unknown stall reason was accepted"
fi
grep -q "no stall reason 'stall_nope'; it has: stall_barrier" "$TMP/noreason.txt" || fail "unknown reason message: $(cat "$TMP/noreason.txt")"
if python3 "$ROOT/scripts/gpu/ncu_lines.py" "$TMP/source.csv" "$TMP/k.sass" --function k --reason stall_barrier --show k.cu:7 > /dev/null 2>&1; then
  fail "--reason with --show was accepted (one would be ignored)"
fi
echo "ncu_lines: ok"
