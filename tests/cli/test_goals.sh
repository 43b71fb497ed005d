#!/usr/bin/env bash
# scripts/gpu/goals.py on hand-made bench output whose verdicts are worked out by hand: each goal met or
# not by the amount the figures give, a goal the run lacks "not measured", a run at another setting or
# without a JSON line refused. Then scripts/gpu/goals with stand-ins for nvidia-smi and the CLI: --only on
# another device builds and times nothing (exit 3); on the named one, the tree's fingerprint heads the log
# and goals.txt, the stand-in CLI's figures reach the table, and a bad --cli or option is refused.
source "$(dirname "$0")/preamble.sh"
PY="$(python3 -c 'import sys; print(sys.executable)')"
GOALS="$ROOT/scripts/gpu/goals.py"

# Forward 0.432 ms (0.018 under 0.45), forward + backward 1.905 ms (0.505 over 1.4, 1.905 / 1.4 = 1.36x), the
# layer 4.97x sustained (0.03x short of 5), 5.21x back to back. The 8K row and a 2 x 32K row must not be read.
cat > "$TMP/run.txt" <<'EOF'
gated delta rule, H=16 Dk=Dv=128 (the bench's table, skipped)
{"device": "cuda", "dtype": "bf16", "heads": 16, "dim": 128, "rows": [{"B": 1, "T": 8192, "fwd_b2b_ms": 0.1, "fwd_bwd_b2b_ms": 0.2}, {"B": 2, "T": 32768, "fwd_b2b_ms": 0.9, "fwd_bwd_b2b_ms": 3.9}, {"B": 1, "T": 32768, "fwd_b2b_ms": 0.432, "fwd_bwd_b2b_ms": 1.905}], "layer": [{"B": 1, "T": 131072, "speedup_sustained": 4.97, "speedup_b2b": 5.21}]}
smi_log: 10 busy samples of 12 (20 ms apart)
EOF
out=$("$PY" "$GOALS" "$TMP/run.txt" --card "NVIDIA H200") || fail "goals.py exit $?: $out"
grep -qF "The kernel goals on NVIDIA H200 (back to back):" <<<"$out" || fail "header: $out"
grep -qF "| forward, B1 T32K | <= 0.45 ms | 0.432 ms | met (0.018 ms under) |" <<<"$out" || fail "forward: $out"
grep -qF "| forward + backward, B1 T32K | <= 1.4 ms | 1.905 ms | not met (0.505 ms over, 1.36x the target) |" <<<"$out" ||
  fail "forward + backward: $out"
grep -qF "| 4.97x (5.21x back to back) | not met (0.03x short) |" <<<"$out" || fail "layer: $out"

# No layer, and no B1 T32K row: those goals read "not measured"; the layer's met by 0.08x.
cat > "$TMP/part.txt" <<'EOF'
{"device": "cuda:0", "dtype": "bf16", "heads": 16, "dim": 128, "rows": [{"B": 4, "T": 8192, "fwd_b2b_ms": 0.5, "fwd_bwd_b2b_ms": 2.1}]}
EOF
out=$("$PY" "$GOALS" "$TMP/part.txt") || fail "goals.py on a partial run, exit $?: $out"
[[ $(grep -c "| - | not measured |" <<<"$out") == 3 ]] || fail "three goals not measured: $out"
grep -qF "The kernel goals (back to back):" <<<"$out" || fail "header without a card: $out"
cat > "$TMP/layer.txt" <<'EOF'
{"device": "cuda", "dtype": "bf16", "heads": 16, "dim": 128, "rows": [], "layer": [{"B": 1, "T": 131072, "speedup_sustained": 5.08}]}
EOF
out=$("$PY" "$GOALS" "$TMP/layer.txt") || fail "goals.py exit $?: $out"
grep -qF "| 5.08x | met (0.08x over) |" <<<"$out" || fail "layer met: $out"

# Refused: float16, 8 heads, a CPU run; no JSON line; no file.
for bad in '"dtype": "f16", "heads": 16' '"dtype": "bf16", "heads": 8'; do
  printf '{"device": "cuda", %s, "dim": 128, "rows": []}\n' "$bad" > "$TMP/bad.txt"
  set +e
  err=$("$PY" "$GOALS" "$TMP/bad.txt" 2>&1); rc=$?
  set -e
  [[ $rc == 2 ]] || fail "a run at another setting: exit $rc, $err"
  grep -q "bad.txt was run at .*the goals are set at device cuda, dtype bf16, heads 16, dim 128" <<<"$err" || fail "setting: $err"
done
printf '{"device": "cpu", "dtype": "bf16", "heads": 16, "dim": 128, "rows": []}\n' > "$TMP/cpu.txt"
if "$PY" "$GOALS" "$TMP/cpu.txt" 2> /dev/null; then fail "a CPU run taken"; fi
echo "no json here" > "$TMP/none.txt"
set +e
err=$("$PY" "$GOALS" "$TMP/none.txt" 2>&1); rc=$?
[[ $rc == 2 ]] && grep -q "no JSON line in .*none.txt" <<<"$err" || fail "no JSON line: exit $rc, $err"
echo '{"device": cuda' > "$TMP/broken.txt"
err=$("$PY" "$GOALS" "$TMP/broken.txt" 2>&1); rc=$?
[[ $rc == 2 ]] && grep -q "broken.txt: the JSON line does not parse" <<<"$err" || fail "a broken JSON line: exit $rc, $err"
err=$("$PY" "$GOALS" "$TMP/missing.txt" 2>&1); rc=$?
[[ $rc == 2 ]] && grep -q "cannot read .*missing.txt" <<<"$err" || fail "no file: exit $rc, $err"
set -e

# The wrapper, run from a scratch repository holding the scripts it runs (so that the tree it fingerprints
# does not change while the test runs). A stand-in nvidia-smi names the device from $CARD and gives smi_log a
# few samples; a stand-in CLI prints run.txt's JSON line.
repo="$TMP/repo"
mkdir -p "$repo/scripts/gpu"
cp "$ROOT"/scripts/gpu/{goals,goals.py,ab_summary.py,smi_log.py,variants.sh} "$repo/scripts/gpu/"
printf '#!/usr/bin/env bash\nexit 3\n' > "$repo/scripts/gpu-check"  # (never run: --cli)
commit_scratch_repo "$repo"
GOALS_SH="$repo/scripts/gpu/goals"
mkdir -p "$TMP/bin"
cat > "$TMP/bin/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
if [[ "$*" == *--query-gpu=name* ]]; then echo "$CARD"; exit 0; fi
[[ "$*" == *-lms* ]] || exit 0
echo "2026/12/02 06:00:00.100, 1900, 1980, 600.00, 700.00, 50, Not Active, Not Active, Not Active, Not Active, Not Active"
exec sleep 30
SMI
cat > "$TMP/cli" <<EOF
#!/usr/bin/env bash
echo "args: \$*" > "$TMP/cli-args.txt"
grep '^{' "$TMP/run.txt"
EOF
chmod +x "$TMP/bin/nvidia-smi" "$TMP/cli"
set +e
out=$(CARD="NVIDIA H100 80GB HBM3" PATH="$TMP/bin:$PATH" OUT="$TMP/o1" "$GOALS_SH" --only H200 --cli "$TMP/cli" 2>&1)
rc=$?
set -e
[[ $rc == 3 ]] || fail "--only on another device: exit $rc, $out"
grep -qF "not a device named *H200*: nothing built or timed" <<<"$out" || fail "--only's message: $out"
[[ ! -e "$TMP/cli-args.txt" && ! -e "$TMP/o1/build.log" ]] || fail "--only on another device ran something"

out=$(CARD="NVIDIA H200" PATH="$TMP/bin:$PATH" OUT="$TMP/o2" "$GOALS_SH" --only H200 --cli "$TMP/cli" --quick 2>&1) ||
  fail "goals on the named device: $out"
grep -qF "==> device: NVIDIA H200" <<<"$out" || fail "device line: $out"
# The tree's line: variants.sh's fingerprint of this repository, with HEAD, in the log and atop goals.txt.
tree=$(cd "$repo" && source scripts/gpu/variants.sh && tree_fingerprint)
grep -qE "^==> tree: $tree \(HEAD [0-9a-f]+\)$" <<<"$out" || fail "the tree's line ($tree): $out"
[[ "$(head -1 "$TMP/o2/goals.txt")" == "$(grep '^==> tree: ' <<<"$out")" ]] || fail "goals.txt's first line: $(head -2 "$TMP/o2/goals.txt")"
grep -qF "| forward, B1 T32K | <= 0.45 ms | 0.432 ms | met (0.018 ms under) |" <<<"$out" || fail "the table: $out"
grep -qF "| forward, B1 T32K | <= 0.45 ms | 0.432 ms |" "$TMP/o2/goals.txt" || fail "goals.txt"
grep -qF "args: bench gdn --device cuda --dtype bf16 --shapes 1x32768 --iters 10" "$TMP/cli-args.txt" ||
  fail "the bench's arguments with --quick: $(cat "$TMP/cli-args.txt")"
[[ ! -e "$TMP/o2/build.log" ]] || fail "--cli built anyway"
if grep -q '^{' <<<"$out"; then fail "the bench's JSON line shown with the power log's summary: $out"; fi
grep -q '^{' "$TMP/o2/bench.txt" || fail "bench.txt lacks the bench's output"

set +e
err=$(OUT="$TMP/o3" "$GOALS_SH" --cli "$TMP/no-such-cli" 2>&1); rc=$?
[[ $rc == 2 ]] && grep -q "is not an executable file" <<<"$err" || fail "a bad --cli: exit $rc, $err"
err=$("$GOALS_SH" --fast 2>&1); rc=$?
[[ $rc == 2 ]] && grep -q "unknown option --fast" <<<"$err" || fail "an unknown option: exit $rc, $err"
set -e
echo "goals: verdicts, refusals and the wrapper as expected"
