#!/usr/bin/env bash
# scripts/random-checkpoint: a checkpoint hydrahead loads, with the config's shape (--layers and --vocab
# applied), the hand-counted number of parameters, norms of 1 and projections of the documented range;
# bad input names itself and leaves nothing behind.
source "$(dirname "$0")/preamble.sh"
HH="$HH_BIN_DIR/hydrahead"
GEN="$ROOT/scripts/random-checkpoint"

cat > "$TMP/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 999, "hidden_size": 32,
 "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
 "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000,
 "tie_word_embeddings": false, "attention_bias": false, "torch_dtype": "float32"}
JSON
"$GEN" "$TMP/config.json" "$TMP/m" --layers 2 --vocab 50 --seed 3 > "$TMP/out.txt" 2>&1 || fail "random-checkpoint: $(cat "$TMP/out.txt")"
json=$("$HH" inspect --json --model "$TMP/m")
# Hand count: embed and lm_head 50*32 each; per layer q 32*32, k and v 16*32 each, o 32*32, norms
# 8 + 8 + 32 + 32, MLP 3*48*32; the final norm 32.
per_layer=$((32 * 32 + 2 * 16 * 32 + 32 * 32 + 8 + 8 + 32 + 32 + 3 * 48 * 32))
want=$((2 * 50 * 32 + 2 * per_layer + 32))
python3 - "$json" "$want" <<'PY' || fail "inspect: $json"
import json, sys
j, want = json.loads(sys.argv[1]), int(sys.argv[2])
assert j["num_layers"] == 2 and j["num_heads"] == 4 and j["num_kv_heads"] == 2 and j["head_dim"] == 8, j
assert j["parameters"] == want and j["dtype"] == "BF16", (j["parameters"], want, j["dtype"])
PY
# The values themselves, read back from the file: the norms 1, the projections within +-[2^-7, 2^-5)
# with both signs.
python3 - "$TMP/m/model.safetensors" <<'PY' || fail "the checkpoint's values"
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header, body = json.loads(data[8:8 + n]), data[8 + n:]
def values(name):
    a, b = header[name]["data_offsets"]
    return [struct.unpack("<f", b"\0\0" + body[i:i + 2])[0] for i in range(a, b, 2)]
assert set(values("model.layers.1.post_attention_layernorm.weight")) == {1.0}
w = values("model.layers.0.self_attn.q_proj.weight")
assert len(w) == 32 * 32 and all(2 ** -7 <= abs(x) < 2 ** -5 for x in w), (min(map(abs, w)), max(map(abs, w)))
assert any(x < 0 for x in w) and any(x > 0 for x in w)
PY
# It runs: a forward through the CLI.
"$HH" run --model "$TMP/m" --tokens 1,2,3 --out "$TMP/run.h5" > /dev/null 2>&1 || fail "run on the random checkpoint"

# An existing output, a missing config and a bad field are refused by name, and nothing is left behind.
set +e
msg=$("$GEN" "$TMP/config.json" "$TMP/m" 2>&1); rc=$?
[[ $rc -ne 0 ]] && grep -q "already exists" <<<"$msg" || fail "an existing output: $rc $msg"
msg=$("$GEN" "$TMP/none.json" "$TMP/n" 2>&1); rc=$?
[[ $rc -ne 0 ]] && grep -q "none.json" <<<"$msg" || fail "a missing config: $rc $msg"
msg=$("$GEN" "$TMP/config.json" "$TMP/n" --layers 0 2>&1); rc=$?
[[ $rc -ne 0 ]] && grep -q "num_hidden_layers" <<<"$msg" || fail "zero layers: $rc $msg"
set -e
[[ ! -e "$TMP/n" ]] || fail "a refused run left $TMP/n"
if ls "$TMP" | grep -q "\.tmp\."; then fail "a temporary directory was left behind"; fi
echo "random checkpoint: ok"
