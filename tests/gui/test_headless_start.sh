#!/usr/bin/env bash
# hydrahead-workbench started with no display server named and no Qt platform chosen (a server over
# ssh): --help and --version print and exit 0; a plain start exits 1 with a message that names DISPLAY and
# points to the headless CLI (not Qt's message about the xcb plugin); --screenshot renders the window
# offscreen into a PNG of the model's page, given as --screenshot FILE or --screenshot=FILE, and of the
# Runs view with --run DIR.
source "$(dirname "$0")/../cli/preamble.sh"
WB="${HH_BIN_DIR:?HH_BIN_DIR must name the bin folder of the build}/hydrahead-workbench"
bare() { env -u DISPLAY -u WAYLAND_DISPLAY -u QT_QPA_PLATFORM XDG_RUNTIME_DIR="$TMP" "$WB" "$@"; }

out=$(bare --help) || fail "--help exited $?"
grep -q -- "--screenshot <FILE>" <<<"$out" || fail "--help: $out"
out=$(bare --version) || fail "--version exited $?"
grep -q "^hydrahead-workbench [0-9]" <<<"$out" || fail "--version: $out"

rc=0; err=$(bare --model "$ROOT/datasets/models/hydrahead-demo" 2>&1) || rc=$?
[[ $rc == 1 ]] || fail "a start without a display exited $rc, not 1: $err"
grep -q "no display (DISPLAY and WAYLAND_DISPLAY are unset)" <<<"$err" || fail "no-display message: $err"
grep -q "hydrahead --help" <<<"$err" || fail "the message does not point to the CLI: $err"
! grep -qi "xcb" <<<"$err" || fail "Qt's platform message leaked: $err"

for form in "--screenshot $TMP/shot.png" "--screenshot=$TMP/shot.png"; do
  rm -f "$TMP/shot.png"
  # shellcheck disable=SC2086 # the option and its file as two words, or one
  bare --model "$ROOT/datasets/models/hydrahead-demo" $form > "$TMP/shot.log" 2>&1 ||
    fail "$form without a display exited $?: $(cat "$TMP/shot.log")"
  python3 - "$TMP/shot.png" <<'PY' || fail "$form: the screenshot is not a PNG of a window"
import struct, sys
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
w, h = struct.unpack(">II", data[16:24])
assert w >= 640 and h >= 400, (w, h)
PY
done
# --run DIR: a run directory opens in the Runs view (here one of a one-step job); a folder without a
# run.h5 is refused by name, with exit status 1.
HH="${HH_BIN_DIR}/hydrahead"
DEMO="$ROOT/datasets/models/hydrahead-demo"
"$HH" select --model "$DEMO" --strategy random --ratio 7 --seed 1 --out "$TMP/m.json" > /dev/null
python3 -c "import struct, sys; sys.stdout.buffer.write(struct.pack('<512I', *[(7 * i) % 1000 for i in range(512)]))" > "$TMP/ids.bin"
cat > "$TMP/job.json" <<JSON
{"teacher": "$DEMO", "manifest": "$TMP/m.json", "output": "$TMP/run", "data": [{"bin": "$TMP/ids.bin"}],
 "stages": [{"name": "align", "steps": 1, "lr": 0.001, "seq_len": 64, "eval_batches": 1}]}
JSON
"$HH" train --job "$TMP/job.json" --progress none || fail "the one-step job exited $?"
bare --run "$TMP/run" --screenshot "$TMP/run.png" > "$TMP/run.log" 2>&1 || fail "--run exited $?: $(cat "$TMP/run.log")"
[[ -s "$TMP/run.png" ]] || fail "--run: no screenshot"
rc=0; err=$(bare --run "$TMP" --screenshot "$TMP/no-run.png" 2>&1) || rc=$?
[[ $rc == 1 ]] || fail "--run on a folder without run.h5 exited $rc, not 1: $err"
grep -q "no run.h5" <<<"$err" || fail "--run's message: $err"
echo "workbench without a display: ok"
