#!/usr/bin/env python3
"""Writes Hugging Face Qwen3 reference logits for model_test_qwen3_forward's Qwen3Hf test.

  make_hf_reference.py OUT_DIR      then   HH_QWEN3_HF_REF=OUT_DIR [HH_QWEN3_HF_DEVICE=cuda] model_test_qwen3_forward

Per case: an HF checkpoint dir OUT_DIR/<case>/ (random weights) and OUT_DIR/<case>.ref.safetensors with
"input_ids" and "logits.{f32|bf16}.{eager|sdpa}.{cpu|cuda}".
"""
import os, sys
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
cases = {
    "gqa_tied": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                     attention_bias=False, T=40, B=2),
    "bias_untied": dict(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=False,
                        attention_bias=True, T=33, B=1),
    "long_1500": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      attention_bias=False, T=1500, B=1),
}
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for case_index, (name, c) in enumerate(cases.items()):
    c = dict(c)
    T, B = c.pop("T"), c.pop("B")
    torch.manual_seed(1000 + case_index)
    cfg = Qwen3Config(**c, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
            elif pname.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    path = os.path.join(out, name)
    model.save_pretrained(path)
    ids = torch.randint(0, c["vocab_size"], (B, T))
    tensors = {"input_ids": ids}
    for dev in devices:
        for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            for impl in ("eager", "sdpa"):
                m = Qwen3ForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=impl).to(dev).eval()
                with torch.no_grad():
                    logits = m(ids.to(dev)).logits.float().cpu().contiguous()
                tensors[f"logits.{dt_name}.{impl}.{dev}"] = logits
    save_file(tensors, os.path.join(out, name + ".ref.safetensors"))
    print(name, "ok", flush=True)
