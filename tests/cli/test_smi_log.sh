#!/usr/bin/env bash
# scripts/gpu/smi_log.py against a stand-in nvidia-smi whose samples are known: the command's output and
# exit status pass through, idle samples are left out, and the clock, power and slowdown-reason figures
# are those of the busy samples; without nvidia-smi the command still runs.
source "$(dirname "$0")/preamble.sh"
PY="$(python3 -c 'import sys; print(sys.executable)')"  # the interpreter itself, not a wrapper that needs PATH

# Eight samples: two idle (345 MHz), six busy at 1500 .. 1980 MHz, the power cap active in three of those.
mkdir -p "$TMP/bin"
cat > "$TMP/bin/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
[[ "$*" == *-lms* ]] || exit 0  # the field probe: every field known
cat <<'CSV'
2026/12/02 06:00:00.000, 345, 1980, 80.00, 700.00, 35, Not Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.100, 1500, 1980, 690.00, 700.00, 50, Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.200, 1600, 1980, 695.00, 700.00, 51, Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.300, 1980, 1980, 300.00, 700.00, 52, Not Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.400, 1700, 1980, 700.00, 700.00, 53, Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.500, 1900, 1980, 500.00, 700.00, 54, Not Active, Not Active, Not Active, Not Active, Active
2026/12/02 06:00:00.600, 1800, 1980, 600.00, 700.00, 55, Not Active, Not Active, Not Active, Not Active, Not Active
2026/12/02 06:00:00.700, 345, 1980, 90.00, 700.00, 40, Not Active, Not Active, Not Active, Not Active, Not Active
CSV
exec sleep 30
SMI
chmod +x "$TMP/bin/nvidia-smi"

set +e
PATH="$TMP/bin:$PATH" "$PY" "$ROOT/scripts/gpu/smi_log.py" --csv "$TMP/samples.csv" -- \
  bash -c 'sleep 0.5; echo from-the-command; exit 3' > "$TMP/out.txt" 2> "$TMP/err.txt"
rc=$?
set -e
[[ $rc == 3 ]] || fail "the command's exit status: $rc"
grep -qx "from-the-command" "$TMP/out.txt" || fail "the command's output: $(cat "$TMP/out.txt")"
err=$(cat "$TMP/err.txt")
grep -q "6 busy samples of 8" <<<"$err" || fail "busy samples: $err"
# Clocks 1500 1600 1700 1800 1900 1980: median 1750, 10th percentile the lowest.
grep -q "SM clock MHz: median 1750, 10th percentile 1500, lowest 1500, highest 1980 (the device's most 1980)" <<<"$err" \
  || fail "clocks: $err"
# Power 300 500 600 690 695 700: median 645, 90th percentile the highest.
grep -q "power W: median 645, 90th percentile 700, highest 700 (limit 700)" <<<"$err" || fail "power: $err"
grep -q "sw_power_cap: active in 50 % of busy samples" <<<"$err" || fail "power cap: $err"
grep -q "hw_thermal_slowdown: active in 17 % of busy samples" <<<"$err" || fail "thermal: $err"
[[ "$(wc -l < "$TMP/samples.csv")" == 9 ]] || fail "the raw samples with their header: $(cat "$TMP/samples.csv")"

# More samples than a pipe holds (3000 lines, about 330 KB): every one reaches the file, none is held up.
cat > "$TMP/bin/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
[[ "$*" == *-lms* ]] || exit 0
for ((i = 0; i < 3000; ++i)); do
  echo "2026/12/02 06:00:00.000, 1980, 1980, 500.00, 700.00, 50, Not Active, Not Active, Not Active, Not Active, Not Active"
done
exec sleep 30
SMI
PATH="$TMP/bin:$PATH" "$PY" "$ROOT/scripts/gpu/smi_log.py" --csv "$TMP/many.csv" -- bash -c 'sleep 1' 2> "$TMP/err3.txt" \
  || fail "many samples: $(cat "$TMP/err3.txt")"
[[ "$(wc -l < "$TMP/many.csv")" == 3001 ]] || fail "many samples kept: $(wc -l < "$TMP/many.csv") lines, expected 3001"
grep -q "3000 busy samples of 3000" "$TMP/err3.txt" || fail "many samples' summary: $(cat "$TMP/err3.txt")"

# No nvidia-smi on the PATH: the command runs, with a note.
mkdir -p "$TMP/none"
ln -s "$(command -v bash)" "$TMP/none/bash"
PATH="$TMP/none" "$PY" "$ROOT/scripts/gpu/smi_log.py" -- bash -c 'exit 0' 2> "$TMP/err2.txt" || fail "without nvidia-smi"
grep -q "no nvidia-smi here" "$TMP/err2.txt" || fail "the note: $(cat "$TMP/err2.txt")"
echo "smi_log: ok"
