"""Timing on the current CUDA device for the scripts beside this file."""
import statistics

import torch


def median_ms(fn, warmup=3, iters=10):
    """Median milliseconds of `iters` calls of fn, each between two CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
