#!/usr/bin/env python3
"""Compare `hydrahead run` with Hugging Face Qwen3ForCausalLM on a random-weight model.

Builds a Qwen3 model from a config of the requested shape with random weights, saves it with
save_pretrained (an ordinary HF checkpoint directory), runs the same token ids through HF and through
`hydrahead run`, and reports the logits' error in fp32 and bf16. Also times both forwards at the
requested length. Prints one JSON object per measurement, and a summary table.

  hf_parity.py --hydrahead build-gpu/bin/hydrahead --workdir /tmp/parity [--shape qwen3-0.6b]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    # Qwen3-0.6B's published configuration (weights random).
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen3-1.7B's shape (the anchors of the patching figures).
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def make_model(shape, path, seed):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    cfg = Qwen3Config(**SHAPES[shape], rope_theta=1000000.0)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    # Larger than HF's 0.02 init so that attention patterns are far from uniform and errors show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)


def hf_logits(path, ids, dtype):
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        out = model(x).logits[0].float().cpu().numpy()
    return model, out


def ours_logits(exe, path, ids, dtype, out_file):
    cmd = [exe, "run", "--model", path, "--tokens", ",".join(map(str, ids)), "--out", out_file,
           "--device", "cuda", "--dtype", dtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"hydrahead run failed ({r.returncode}): {r.stderr}")
    with h5py.File(out_file, "r") as f:
        return f["logits"][...], r.stderr.strip()


def errors(ours, ref):
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    scale = np.abs(ref).max()
    top_ours = ours.argmax(-1)
    top_ref = ref.argmax(-1)
    return {
        "max_abs": float(diff.max()),
        "max_rel_to_max": float(diff.max() / scale),            # max |a-b| / max |b|
        "mean_abs": float(diff.mean()),
        "argmax_agree": float((top_ours == top_ref).mean()),
    }


def time_hf(model, T, iters):
    x = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            model(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hydrahead", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=512, help="length of the parity input")
    ap.add_argument("--bench-tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, args.shape)
    make_model(args.shape, path, args.seed)
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, SHAPES[args.shape]["vocab_size"], size=args.tokens).tolist()

    results = {"shape": args.shape, "T": args.tokens, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name()}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        model, ref = hf_logits(path, ids, dtype)
        ours, log = ours_logits(args.hydrahead, path, ids, name, os.path.join(args.workdir, f"ours-{name}.h5"))
        results[name] = errors(ours, ref)
        results[name]["hydrahead_log"] = log
        if name == "bf16":
            results["hf_bf16_ms"] = time_hf(model, args.bench_tokens, args.iters)
        del model
        torch.cuda.empty_cache()

    bench = subprocess.run([args.hydrahead, "bench", "forward", "--model", path, "--device", "cuda",
                            "--dtype", "bf16", "--seq", str(args.bench_tokens), "--batch", "1",
                            "--iters", str(args.iters), "--json"], capture_output=True, text=True)
    if bench.returncode == 0:
        results["hydrahead_bf16"] = json.loads(bench.stdout)
    else:
        results["hydrahead_bench_error"] = bench.stderr.strip()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
