#!/usr/bin/env bash
# hydrahead-workbench started with no display server named and no Qt platform chosen (a server over
# ssh): --help and --version print and exit 0; a plain start exits 1 with a message that names DISPLAY and
# points to the headless CLI (not Qt's message about the xcb plugin); --screenshot renders the window
# offscreen into a PNG of the model's page, given as --screenshot FILE or --screenshot=FILE.
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
echo "workbench without a display: ok"
