#!/usr/bin/env python3
"""The hybrid layer's two largest parts on their own, timed with torch on the same GPU.

1. The projections: x^ [T, d] times W^T for the output widths the hybrid layer asks cuBLAS for (each
   product apart, and merged into one), in TFLOP/s.
2. The FA heads' causal attention (B=1, H heads, T, Dh) through each SDPA backend torch offers, with
   q, k, v contiguous [B, H, T, Dh], as the layer passes them (head slices of [B, T, width] rows), or
   contiguous with q and k formed as the layer forms them (unit-RMS rows, q log-scaled by position).

  python3 scripts/gpu/layer_parts_bench.py [--seq 131072] [--d 2048] [--dh 128]
Medians of CUDA-event timings after warm-up; fresh random inputs (never zeros).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--dh", type=int, default=128)
    p.add_argument("--fa-heads", type=int, default=2)
    p.add_argument("--la-heads", type=int, default=14)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    T, d, Dh, nF, nL = a.seq, a.d, a.dh, a.fa_heads, a.la_heads
    x = torch.randn(T, d, device=dev, dtype=dt)
    print(f"projections of x [{T}, {d}] bf16 (torch {torch.__version__}, {torch.cuda.get_device_name()}):")
    # Output widths; the FA heads' k and v as when each reads a KV group of its own (bench gdn's layer).
    widths = {
        "FA q,k,v,gate": 4 * nF * Dh,
        "LA q": nL * Dh,
        "LA gate+b+a (padded to 8)": nL * Dh + 2 * nL + (8 - 2 * nL % 8) % 8,
        "LA q,k,v merged": 3 * nL * Dh,
        "LA q,k,v,gate,b,a merged": 4 * nL * Dh + 2 * nL + (8 - 2 * nL % 8) % 8,
        "everything merged": 4 * nF * Dh + 4 * nL * Dh + 2 * nL + (8 - 2 * nL % 8) % 8,
        "o_proj (d -> d)": d,
    }
    for name, n in widths.items():
        w = torch.randn(n, d, device=dev, dtype=dt) * 0.02
        ms = median_ms(lambda: F.linear(x, w))
        print(f"  {name:28s} N={n:5d}  {ms:7.3f} ms  {2 * T * d * n / ms / 1e9:6.1f} TFLOP/s")
        del w
    del x
    torch.cuda.empty_cache()

    flops = lambda H: 4 * T * T / 2 * Dh * H
    print(f"causal attention B=1 T={T} Dh={Dh} bf16 (median of 5 a round; the variants alternate within each round,")
    print("  so that the device's clocks, which fall under sustained load, weigh on each alike):")
    for H in (nF, 16):
        qc, kc, vc = (torch.randn(1, H, T, Dh, device=dev, dtype=dt) for _ in range(3))
        wide = torch.randn(1, T, 4 * H * Dh, device=dev, dtype=dt)  # the layer's merged product, heads as slices
        ql = wide[..., : H * Dh].view(1, T, H, Dh).transpose(1, 2)
        kl = wide[..., H * Dh : 2 * H * Dh].view(1, T, H, Dh).transpose(1, 2)
        vl = wide[..., 2 * H * Dh : 3 * H * Dh].view(1, T, H, Dh).transpose(1, 2)
        # Inputs as the layer forms them: unit-RMS rows (q_norm / k_norm), q log-scaled by position.
        log_scale = (torch.arange(T, device=dev, dtype=torch.float32) + 512).log() / torch.log(torch.tensor(512.0))
        qn = (F.rms_norm(qc.float(), (Dh,)) * log_scale.view(1, 1, T, 1)).to(dt)
        kn = F.rms_norm(kc.float(), (Dh,)).to(dt)
        variants = {"contiguous": (qc, kc, vc), "layer views": (ql, kl, vl), "normed, contiguous": (qn, kn, vc)}
        backends = [SDPBackend.CUDNN_ATTENTION] if H == 16 else [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                                SDPBackend.EFFICIENT_ATTENTION]
        for backend in backends:
            rounds = 3 if backend == SDPBackend.CUDNN_ATTENTION else 1
            got = {name: [] for name in variants}
            try:
                for _ in range(rounds):
                    for name, (q, k, v) in variants.items():
                        with sdpa_kernel([backend]):
                            got[name].append(median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                       warmup=1, iters=5))
            except RuntimeError as e:
                print(f"  H={H:2d} {backend.name:20s} not available: {str(e).splitlines()[0][:80]}")
                continue
            for name, ms in got.items():
                m = statistics.median(ms)
                rs = " ".join(f"{x:.2f}" for x in ms)
                print(f"  H={H:2d} {backend.name:20s} {name:19s} {m:8.2f} ms  {flops(H) / m / 1e9:6.1f} TFLOP/s  (rounds: {rs})")
        del qc, kc, vc, wide, ql, kl, vl, qn, kn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
