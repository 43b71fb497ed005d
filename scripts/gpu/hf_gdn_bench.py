#!/usr/bin/env python3
"""Times Hugging Face's torch implementation of the chunked gated delta rule (the Qwen3-Next modeling
file's torch_chunk_gated_delta_rule) at the shapes `hydrahead bench gdn` uses, forward and forward +
backward, bf16 inputs on the GPU; prints one JSON object.

    python3 scripts/gpu/hf_gdn_bench.py --shapes 1x8192,1x32768 --heads 16 --dim 128 [--max-seq 32768]
"""
import argparse
import json
import sys

import torch

from cuda_timing import median_ms


def hf_rule():
    for mod in ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5"):
        try:
            m = __import__(mod, fromlist=["torch_chunk_gated_delta_rule"])
            return mod, m.torch_chunk_gated_delta_rule
        except (ImportError, AttributeError):
            continue
    sys.exit("no torch_chunk_gated_delta_rule in this transformers")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x8192,1x32768,4x8192")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=32768, help="skip longer sequences (the loop over chunks is slow)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    where, rule = hf_rule()
    out = {"implementation": where + ".torch_chunk_gated_delta_rule", "rows": []}
    for item in a.shapes.split(","):
        B, T = (int(x) for x in item.split("x"))
        if T > a.max_seq:
            continue
        dev, bf = "cuda", torch.bfloat16
        q = torch.nn.functional.normalize(torch.randn(B, T, a.heads, a.dim, device=dev), dim=-1).to(bf)
        k = torch.nn.functional.normalize(torch.randn(B, T, a.heads, a.dim, device=dev), dim=-1).to(bf)
        v = torch.randn(B, T, a.heads, a.dim, device=dev, dtype=bf)
        g = (-0.5 * torch.rand(B, T, a.heads, device=dev)).to(bf)
        beta = torch.rand(B, T, a.heads, device=dev, dtype=bf)
        with torch.no_grad():
            fwd = median_ms(lambda: rule(q, k, v, g, beta, chunk_size=64), a.warmup, a.iters)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        dO = torch.randn_like(v)

        def fwd_bwd():
            o, _ = rule(*leaves, chunk_size=64)
            o.backward(dO)
            for t in leaves:
                t.grad = None

        out["rows"].append({"B": B, "T": T, "fwd_ms": fwd, "fwd_bwd_ms": median_ms(fwd_bwd, a.warmup, a.iters)})
        print(f"HF torch B={B} T={T}: fwd {fwd:.3f} ms, fwd+bwd {out['rows'][-1]['fwd_bwd_ms']:.3f} ms", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
