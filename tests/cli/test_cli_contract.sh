#!/usr/bin/env bash
# The CLI contract: sub-commands listed, exit codes, clean errors without partial output.
set -euo pipefail
HH="$HH_BIN_DIR/hydrahead"
TMP="$HH_TEST_TMP/cli_contract"
rm -rf "$TMP" && mkdir -p "$TMP"
fail() { echo "FAIL: $*" >&2; exit 1; }

help=$("$HH" --help)
for sub in inspect run tokenize tasks analyze select convert train eval demo bench; do
  grep -qE "^  $sub " <<<"$help" || fail "--help does not list '$sub'"
done

# Missing checkpoint: status 1 and the path in the message.
set +e; msg=$("$HH" inspect --model "$TMP/nope" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "inspect on a missing dir exited $rc"
grep -q "$TMP/nope" <<<"$msg" || fail "message does not name the directory: $msg"

# Garbled config.json: status 1, the file named, and `run` leaves no output file behind.
mkdir -p "$TMP/bad"
printf '{"hidden_size": 64, "num_hidden_layers": ' > "$TMP/bad/config.json"
set +e; msg=$("$HH" run --model "$TMP/bad" --tokens 1,2 --out "$TMP/out.h5" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "run with a garbled config exited $rc: $msg"
grep -q "config.json" <<<"$msg" || fail "message does not name config.json: $msg"
[[ ! -e "$TMP/out.h5" ]] || fail "a partial output file was left behind"
ls "$TMP" | grep -q "out.h5" && fail "a temporary output file was left behind"

# A job spec with a mistake: status 1, the file and the field named, nothing created.
printf '{"output": "%s/run", "data": [{"bin": "x.bin"}], "stages": [{"name": "align", "steps": 0, "lr": 1, "seq_len": 8}]}' "$TMP" > "$TMP/job.json"
set +e; msg=$("$HH" train --job "$TMP/job.json" 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] || fail "train with a bad job exited $rc: $msg"
grep -q "job.json" <<<"$msg" && grep -q "stages\[0\].steps" <<<"$msg" || fail "message does not name the file and field: $msg"
[[ ! -e "$TMP/run" ]] || fail "a refused job created its output directory"

# Usage errors exit 2.
set +e; "$HH" run --model "$TMP/bad" >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || fail "run without --out/--tokens exited $rc, expected 2"
set +e; "$HH" tokenize --tokenizer x.json --model y --text hi >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || fail "tokenize with both --tokenizer and --model exited $rc, expected 2"
# bench gdn runs on the CPU too (tiny shapes) and reports every shape, without the CUDA-only
# comparison columns (the same path again there); a bad shape is named.
out=$("$HH" bench gdn --device cpu --dtype f32 --shapes 1x70,2x16 --heads 2 --dim 16 --iters 1 --warmup 0 --json)
json=$(grep '^{' <<<"$out")
python3 -c 'import json,sys; r=json.loads(sys.argv[1])["rows"]; assert [(x["B"],x["T"]) for x in r]==[(1,70),(2,16)] and all(x["fwd_ms"]>0 and x["ref_fwd_ms"]>0 and "fwd_local_libtorch_ms" not in x and "fwd_tf32_scan_ms" not in x for x in r), r' "$json" \
  || fail "bench gdn JSON: $json"
# Each row's own back-to-back figures are the median of three windows, which the JSON keeps.
python3 -c 'import json,sys
for x in json.loads(sys.argv[1])["rows"]:
    for k in ("fwd", "fwd_bwd"):
        w = x[k + "_b2b_windows_ms"]
        assert len(w) == 3 and min(w) > 0 and x[k + "_b2b_ms"] == sorted(w)[1], (k, x)
        # The host queued the runs of a window before the window ended; on the CPU, whose sync waits for
        # nothing, the two are one time (within 0.05 ms a run).
        h = x[k + "_b2b_host_windows_ms"]
        assert len(h) == 3 and all(0 < a <= b < a + 0.05 for a, b in zip(h, w)), (k, x)' "$json" \
  || fail "bench gdn back-to-back windows JSON: $json"
grep -q "the host queues a run in" <<<"$out" || fail "bench gdn prints no host line: $out"
# A CUDA device the build or machine lacks is named before anything runs.
if ! "$HH" bench gdn --device cuda:1000 --shapes 1x64 >/dev/null 2>"$TMP/dev.err"; then
  grep -q "device 'cuda:1000'" "$TMP/dev.err" || fail "bench gdn --device cuda:1000 did not name the device: $(cat "$TMP/dev.err")"
else
  fail "bench gdn --device cuda:1000 ran"
fi
# One tiny CPU bench gdn (1x64, 2 heads of 16) with the extra flags given: its output in $out, its JSON
# line in $json.
tiny_gdn() {
  out=$("$HH" bench gdn --device cpu --dtype f32 --shapes 1x64 --heads 2 --dim 16 --iters 1 --warmup 0 \
    --reference-max-seq 0 --json "$@")
  json=$(grep '^{' <<<"$out")
}
# The forward's rates against the ceilings given (each fraction the rate over its ceiling); a ceiling
# that is not positive is refused by name.
tiny_gdn --peak-tflops 0.5 --peak-gbps 2
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); r=j["rows"][0]; assert j["peak_tflops"]==0.5 and j["peak_gbps"]==2 and r["fwd_tflops"]>0 and r["fwd_b2b_ms"]>0 and r["fwd_bwd_b2b_ms"]>0 and abs(r["fwd_tflops_of_peak"]*0.5-r["fwd_tflops"])<1e-9*r["fwd_tflops"] and abs(r["fwd_gbps_of_peak"]*2-r["fwd_gbps"])<1e-9*r["fwd_gbps"], j' "$json" \
  || fail "bench gdn ceilings JSON: $json"
grep -q "ceilings 0.5 TFLOP/s and 2 GB/s" <<<"$out" || fail "bench gdn table names no ceilings: $out"
grep -q "b2b f+b" <<<"$out" && grep -q "1 runs queued back to back" <<<"$out" || fail "bench gdn table has no back-to-back columns: $out"
set +e; msg=$("$HH" bench gdn --device cpu --shapes 1x64 --peak-gbps 0 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] && grep -q -- "--peak-gbps" <<<"$msg" || fail "bench gdn with --peak-gbps 0 exited $rc: $msg"
# --factors-occupancy is recorded, and off CUDA adds no figures (chunk_factors runs there only).
tiny_gdn --factors-occupancy
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["factors_occupancy"] is True and "factors_occupancy" not in j["rows"][0], j' "$json" \
  || fail "bench gdn --factors-occupancy JSON: $json"
grep -q "chunk_factors at" <<<"$out" && fail "bench gdn printed chunk_factors' occupancy on the CPU: $out"
grep -q -- "--factors-occupancy" <<<"$("$HH" bench gdn --help)" || fail "bench gdn --help names no --factors-occupancy"
# --rest-ms is recorded (50 unless given; off CUDA the device never rests); a negative one is refused by name.
for rest in 0 ""; do
  tiny_gdn ${rest:+--rest-ms $rest}
  python3 -c 'import json,sys; assert json.loads(sys.argv[1])["rest_ms"] == int(sys.argv[2] or 50), sys.argv[1]' "$json" "$rest" \
    || fail "bench gdn --rest-ms '$rest' JSON: $json"
done
set +e; msg=$("$HH" bench gdn --device cpu --shapes 1x64 --rest-ms -5 2>&1); rc=$?; set -e
[[ $rc -ne 0 ]] && grep -q -- "--rest-ms" <<<"$msg" || fail "bench gdn with --rest-ms -5 exited $rc: $msg"
# The scan's segments and columns and the gates' range are recorded; a segment length that is not
# auto or a non-negative number is refused by name.
tiny_gdn --scan-segments 4 --scan-columns 16 --gate-max 0.01
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["scan_segments"]=="4" and j["scan_columns"]=="16" and j["gate_max"]==0.01, j' "$json" \
  || fail "bench gdn segments JSON: $json"
grep -q "g ~ -U(0, 0.01), scan segments 4, columns 16;" <<<"$out" || fail "bench gdn table names no gates or segments: $out"
for bad in -1 3x; do
  set +e; msg=$("$HH" bench gdn --device cpu --shapes 1x64 --scan-segments "$bad" 2>&1); rc=$?; set -e
  [[ $rc -eq 1 ]] && grep -q -- "--scan-segments" <<<"$msg" && grep -q -- "'$bad'" <<<"$msg" \
    || fail "bench gdn with --scan-segments $bad exited $rc: $msg"
done
# One attention layer of a tiny config, dense against 3:1 hybrid, on the CPU: a row per shape with both
# times and the paired speed-up.
printf '%s' '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000,
 "tie_word_embeddings": false, "attention_bias": false, "torch_dtype": "float32"}' > "$TMP/tiny.json"
tiny_gdn --layer-config "$TMP/tiny.json" --layer-shapes 1x32,2x16 --ratio 3
python3 -c 'import json,sys; L=json.loads(sys.argv[1])["layer"]; assert [(x["B"],x["T"]) for x in L]==[(1,32),(2,16)] and all(x["dense_ms"]>0 and x["hybrid_ms"]>0 and x["speedup"]>0 and x["dense_b2b_ms"]>0 and x["hybrid_b2b_ms"]>0 and abs(x["speedup"]-x["dense_ms"]/x["hybrid_ms"])<1e-9 and abs(x["speedup_b2b"]-x["dense_b2b_ms"]/x["hybrid_b2b_ms"])<1e-9 for x in L), L' "$json" \
  || fail "bench gdn layer JSON: $json"
grep -q "hybrid 1 FA + 3 LA heads" <<<"$out" && grep -q "in a block of their own" <<<"$out" || fail "bench gdn layer table: $out"
set +e; msg=$("$HH" bench gdn --device cpu --shapes 1y70 2>&1); rc=$?; set -e
[[ $rc -eq 1 ]] && grep -q "1y70" <<<"$msg" || fail "bench gdn with a bad shape exited $rc: $msg"
# What the layer comparison reads is checked before anything is timed: a missing config, a bad layer
# shape or a negative ratio ends the run with its name and no table row.
for case_ in "missing.json|--layer-config $TMP/missing.json" "--layer-shapes|--layer-config $TMP/tiny.json --layer-shapes 1x" \
             "--ratio|--layer-config $TMP/tiny.json --ratio -1"; do
  what=${case_%%|*} args=${case_#*|}
  set +e; msg=$("$HH" bench gdn --device cpu --dtype f32 --shapes 1x64 --heads 2 --dim 16 --iters 1 --warmup 0 $args 2>&1)
  rc=$?; set -e
  [[ $rc -eq 1 ]] && grep -q -- "$what" <<<"$msg" || fail "bench gdn $args exited $rc: $msg"
  if grep -q "^  1 x 64" <<<"$msg"; then fail "bench gdn $args timed the rule before refusing: $msg"; fi
done
# convert says what the hybrid is: its FA and LA head counts and the ratio, or that there is no FA head
# (a layer-wise pattern beyond the model's layers) where a ratio would divide by zero.
DEMO="$HH_SOURCE_DIR/datasets/models/hydrahead-demo"
for fa in '[]' '[[0, 0], [3, 4], [5, 7]]'; do
  printf '{"format": "hydrahead-manifest", "format_version": 1, "model": {"num_layers": 6, "num_heads": 8, "num_kv_heads": 2, "head_dim": 32}, "fa_heads": %s}' "$fa" > "$TMP/manifest.json"
  rm -rf "$TMP/hybrid"
  out=$("$HH" convert --model "$DEMO" --manifest "$TMP/manifest.json" --out "$TMP/hybrid")
  if [[ $fa == '[]' ]]; then want="0 FA and 48 LA heads (no FA head: every head is LA)"; else want="3 FA and 45 LA heads (LA:FA = 15.00:1)"; fi
  grep -qF "$want" <<<"$out" || fail "convert with fa_heads $fa: '$out' does not say '$want'"
done
echo "cli contract: ok"
