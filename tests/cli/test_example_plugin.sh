#!/usr/bin/env bash
# The out-of-tree example plugin (plugins/examples/minimal): configure and build it with its own
# CMakeLists.txt in a scratch folder, load it through HYDRAHEAD_PLUGIN_PATH, list, generate, validate.
# Also `hydrahead tasks` behaviour that needs the binary: refusals on stderr, usage and input errors.
set -euo pipefail
HH="$HH_BIN_DIR/hydrahead"
TMP="$HH_TEST_TMP/example_plugin"
TOK="$HH_TEST_DATA/tokenizer/tiny-tokenizer.json"
rm -rf "$TMP" && mkdir -p "$TMP/xdg"
fail() { echo "FAIL: $*" >&2; exit 1; }

# Keep the user's own plugins out of the test.
export XDG_DATA_HOME="$TMP/xdg"
unset HYDRAHEAD_PLUGIN_PATH

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$HH_SOURCE_DIR/plugins/examples/minimal" -B "$TMP/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release >"$TMP/configure.log" 2>&1 || { cat "$TMP/configure.log" >&2; fail "configure"; }
cmake --build "$TMP/build" >"$TMP/build.log" 2>&1 || { cat "$TMP/build.log" >&2; fail "build"; }
[[ -f "$TMP/build/example_copy.so" ]] || fail "no example_copy.so after the build"
export HYDRAHEAD_PLUGIN_PATH="$TMP/build"

# list: the task, its kind and parameters; JSON too.
list=$("$HH" tasks list)
grep -q "^example-copy  (reasoning)" <<<"$list" || fail "tasks list does not show example-copy: $list"
grep -qE "^ +length +int +default 5 +\[1, 64\]" <<<"$list" || fail "tasks list lacks the length parameter: $list"
json=$("$HH" tasks list --json)
grep -q '"id": "example-copy"' <<<"$json" || fail "tasks list --json lacks example-copy: $json"
grep -q "\"$TMP/build\"" <<<"$json" || fail "tasks list --json lacks the search path: $json"

# generate: N lines, same seed same bytes, another seed other bytes, a summary on stdout.
out=$("$HH" tasks generate --task example-copy --tokenizer "$TOK" --n 7 --length 4 --seed 3 \
  --out "$TMP/a.jsonl" 2>"$TMP/gen.err")
grep -q "wrote 7 examples of example-copy" <<<"$out" || fail "generate summary: $out"
[[ ! -s "$TMP/gen.err" ]] || fail "generate wrote to stderr without a terminal: $(cat "$TMP/gen.err")"
[[ $(wc -l <"$TMP/a.jsonl") -eq 7 ]] || fail "expected 7 lines in a.jsonl"
grep -q '"clean":"Copy: [a-z] [a-z] [a-z] [a-z] ->"' "$TMP/a.jsonl" || fail "unexpected prompt: $(head -1 "$TMP/a.jsonl")"
"$HH" tasks generate --task example-copy --tokenizer "$TOK" --n 7 --length 4 --seed 3 --out "$TMP/b.jsonl" >/dev/null
cmp -s "$TMP/a.jsonl" "$TMP/b.jsonl" || fail "the same seed gave different files"
"$HH" tasks generate --task example-copy --tokenizer "$TOK" --n 7 --param length=4 --seed 4 \
  --out "$TMP/c.jsonl" >/dev/null
cmp -s "$TMP/a.jsonl" "$TMP/c.jsonl" && fail "another seed gave the same file"
ls "$TMP" | grep -q '\.tmp' && fail "a temporary file was left behind"

# validate: the summary, and a broken line named by file and line with status 1.
summary=$("$HH" tasks validate --calib "$TMP/a.jsonl" --tokenizer "$TOK")
grep -q "7 examples" <<<"$summary" || fail "validate summary: $summary"
grep -q "example-copy 7" <<<"$summary" || fail "validate per-task count: $summary"
{ head -2 "$TMP/a.jsonl"; echo '{"task": "x", "clean_ids": [1, 2], "corrupt_ids": [1], "answer_ids": [3]}'; } \
  >"$TMP/bad.jsonl"
set +e; msg=$("$HH" tasks validate --calib "$TMP/bad.jsonl" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "validate of a bad file exited $rc"
grep -q "$TMP/bad.jsonl:3: field 'corrupt_ids'" <<<"$msg" || fail "validate does not name file:line:field: $msg"

# Errors: unknown parameter (status 1, the valid ones listed), unknown task, usage errors (status 2).
set +e; msg=$("$HH" tasks generate --task example-copy --tokenizer "$TOK" --depth 0.5 --out "$TMP/d.jsonl" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "an undeclared --depth exited $rc"
grep -q "has no parameter 'depth'; valid: num_examples, length" <<<"$msg" || fail "unknown parameter message: $msg"
[[ ! -e "$TMP/d.jsonl" ]] || fail "a failed generate left a file"
set +e; msg=$("$HH" tasks generate --task nope --tokenizer "$TOK" --out "$TMP/d.jsonl" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "an unknown task exited $rc"
grep -q "unknown task 'nope'; available: .*example-copy" <<<"$msg" || fail "unknown task message: $msg"
set +e; msg=$("$HH" tasks generate --task example-copy --tokenizer "$TOK" --param length=99 --out "$TMP/d.jsonl" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "an out-of-range parameter exited $rc"
grep -q "parameter 'length' = 99 is out of range \[1, 64\]" <<<"$msg" || fail "range message: $msg"
set +e; "$HH" tasks generate --tokenizer "$TOK" --out "$TMP/d.jsonl" >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || fail "generate without --task exited $rc, expected 2"
set +e; "$HH" tasks generate --task example-copy --out "$TMP/d.jsonl" >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || fail "generate without --model/--tokenizer exited $rc, expected 2"
set +e; "$HH" tasks >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || fail "tasks without a sub-command exited $rc, expected 2"

# A refused library is named on stderr; the others still load, and stdout stays clean JSON.
mkdir -p "$TMP/broken"
echo "not a shared library" >"$TMP/broken/broken.so"
"$HH" tasks list --json --plugin-dir "$TMP/broken" >"$TMP/list.out" 2>"$TMP/list.err"
grep -q "$TMP/broken/broken.so: refused" "$TMP/list.err" || fail "refusal not on stderr: $(cat "$TMP/list.err")"
grep -q "refused" "$TMP/list.out" || fail "refusal missing from the JSON diagnostics"
grep -q '"id": "example-copy"' "$TMP/list.out" || fail "example-copy missing after a refusal"
if [[ -d "$HH_BIN_DIR/../test-plugins" ]]; then
  "$HH" tasks --plugin-dir "$HH_BIN_DIR/../test-plugins" list >"$TMP/list2.out" 2>"$TMP/list2.err"
  grep -q "wrong_version.so: refused: exports hydrahead_plugin_v2" "$TMP/list2.err" \
    || fail "wrong ABI version not reported: $(cat "$TMP/list2.err")"
  grep -q "^example-copy " "$TMP/list2.out" || fail "example-copy missing next to the test plugins"
fi
echo "example plugin: ok"
