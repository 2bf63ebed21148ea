#!/usr/bin/env python3
"""Kernel-level peers for `lowbit bench`, measured with PyTorch on the same GPU in the same run:
bf16 and FP8 dense GEMM, grouped bf16 expert GEMM, SDPA attention forward and forward+backward.
Prints one JSON line per measurement (TFLOP/s by the same FLOP counts as src/bench/bench.c)."""
import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def report(what, seconds, flops):
    print(json.dumps({"peer": what, "ms": round(seconds * 1e3, 3),
                      "tflops": round(flops / seconds / 1e12, 1)}), flush=True)


ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--m", type=int, default=16384)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--k", type=int, default=2048)
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--rows", type=int, default=1024)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--ffn2", type=int, default=1536)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=4096)
ap.add_argument("--heads", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=4)
ap.add_argument("--head-dim", type=int, default=128)
a = ap.parse_args()
dev = "cuda"

x = torch.randn(a.m, a.k, device=dev, dtype=torch.bfloat16)
w = torch.randn(a.n, a.k, device=dev, dtype=torch.bfloat16)
report(f"torch bf16 dense {a.m}x{a.n}x{a.k}", timed(lambda: x @ w.t()), 2.0 * a.m * a.n * a.k)
x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
sx = torch.ones(a.m, 1, device=dev, dtype=torch.float32)
sw = torch.ones(1, a.n, device=dev, dtype=torch.float32)
try:
    report(f"torch fp8 rowwise _scaled_mm {a.m}x{a.n}x{a.k}",
           timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)),
           2.0 * a.m * a.n * a.k)
except Exception as e:  # report what the peer cannot do instead of failing the run
    print(json.dumps({"peer": "torch fp8 rowwise _scaled_mm", "error": str(e)[:200]}))
# FP8 per tensor as lowbit's fp8-tensor: one scalar scale per operand, fp32 output as lowbit's.
try:
    st = torch.ones((), device=dev, dtype=torch.float32)
    report(f"torch fp8 per-tensor _scaled_mm {a.m}x{a.n}x{a.k} (fp32 out)",
           timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=st, scale_b=st, out_dtype=torch.float32)),
           2.0 * a.m * a.n * a.k)
except Exception as e:
    print(json.dumps({"peer": "torch fp8 per-tensor _scaled_mm", "error": str(e)[:200]}))
# FP8 block-scaled as lowbit's fp8-block (DeepSeek-V3): activations 1x128 (scale (m, k/128),
# stored column-major as PyTorch asks), weights 128x128 (scale (k/128, n/128) for the
# column-major B), through cuBLASLt's block scaling (PyTorch 2.9 and later on sm_90). Unit
# scales: the timing does not depend on them.
try:
    sxb = torch.ones(a.k // 128, a.m, device=dev, dtype=torch.float32).t()
    swb = torch.ones(a.n // 128, a.k // 128, device=dev, dtype=torch.float32).t()
    report(f"torch fp8 block 1x128 x 128x128 _scaled_mm {a.m}x{a.n}x{a.k}",
           timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sxb, scale_b=swb, out_dtype=torch.bfloat16)),
           2.0 * a.m * a.n * a.k)
except Exception as e:
    print(json.dumps({"peer": "torch fp8 block _scaled_mm", "error": str(e)[:600]}))

xs = torch.randn(a.experts * a.rows, a.hidden, device=dev, dtype=torch.bfloat16)
ws = torch.randn(a.experts, a.hidden, a.ffn2, device=dev, dtype=torch.bfloat16)
offs = torch.arange(a.rows, a.experts * a.rows + 1, a.rows, device=dev, dtype=torch.int32)
try:
    report(f"torch bf16 _grouped_mm {a.experts}x{a.rows} rows, {a.hidden} -> {a.ffn2}",
           timed(lambda: torch._grouped_mm(xs, ws, offs=offs)),
           2.0 * a.experts * a.rows * a.hidden * a.ffn2)
except Exception as e:
    print(json.dumps({"peer": "torch bf16 _grouped_mm", "error": str(e)[:200]}))
# FP8 grouped with per-row (activation) and per-column (weight) scales: the grouped FP8
# peer. B is (experts, N, K) viewed as (experts, K, N), the column-major layout it asks for.
xs8 = xs.to(torch.float8_e4m3fn)
ws8 = torch.randn(a.experts, a.ffn2, a.hidden, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
sxs = torch.ones(a.experts * a.rows, device=dev, dtype=torch.float32)
sws = torch.ones(a.experts, a.ffn2, device=dev, dtype=torch.float32)
try:
    report(f"torch fp8 rowwise _scaled_grouped_mm {a.experts}x{a.rows} rows, {a.hidden} -> {a.ffn2}",
           timed(lambda: torch._scaled_grouped_mm(xs8, ws8.transpose(-2, -1), sxs, sws, offs=offs,
                                                  out_dtype=torch.bfloat16)),
           2.0 * a.experts * a.rows * a.hidden * a.ffn2)
except Exception as e:
    print(json.dumps({"peer": "torch fp8 rowwise _scaled_grouped_mm", "error": str(e)[:200]}))

q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
fwd_flops = 4.0 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2.0
sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
report(f"torch SDPA fwd b{a.batch} t{a.seq} hq{a.heads} hkv{a.kv_heads} d{a.head_dim}", timed(sdpa), fwd_flops)
g = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=torch.bfloat16)
report(f"torch SDPA fwd+bwd b{a.batch} t{a.seq} hq{a.heads} hkv{a.kv_heads} d{a.head_dim}",
       timed(lambda: sdpa().backward(g)), 3.5 * fwd_flops)
