"""A short timing table on a CUDA GPU: copy bandwidth, then normkit forward and frozen/full backward
(kernel-only and end to end through torch autograd), bf16 and fp32, against torch eager.

Byte model (per M x N call, b = element size): fwd reads x, writes y: 2*M*N*b (+ fused add: reads r,
writes s: +2*M*N*b). bwd reads x and dy, writes dx: 3*M*N*b (+ fused add: reads dres: +M*N*b).
Weights, stats and fp32 partials are not counted (they are < 1% at these shapes).
"""
import argparse

import torch
import triton.testing

from torch_frontend import functional as F

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="8192x8192,32768x4096,4096x1024")
p.add_argument("--dtypes", default="bfloat16,float32")
p.add_argument("--ops", default="rms_norm,layer_norm,fused_add_rms_norm")
args = p.parse_args()
dev = torch.device("cuda")


def bench(fn, rep=40):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


def copy_tbps():
    a = torch.empty(2**30, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), rep=100)
    return 2 * a.numel() * 2 / (t * 1e-6) / 1e12


COPY = copy_tbps()
print(f"copy bandwidth: {COPY:.2f} TB/s", flush=True)
rows = []
for dt_name in args.dtypes.split(","):
    dt = getattr(torch, dt_name)
    for shape in args.shapes.split(","):
        M, N = map(int, shape.split("x"))
        b = dt.itemsize
        for op in args.ops.split(","):
            x = torch.randn(M, N, device=dev, dtype=dt)
            r = torch.randn(M, N, device=dev, dtype=dt) if op == "fused_add_rms_norm" else None
            w = torch.randn(N, device=dev, dtype=dt)
            bias = torch.randn(N, device=dev, dtype=dt) if op == "layer_norm" else None
            dy = torch.randn(M, N, device=dev, dtype=dt)
            dres = torch.randn(M, N, device=dev, dtype=dt) if r is not None else None
            extra = 2 if r is not None else 0
            fwd_bytes = (2 + extra) * M * N * b
            bwd_bytes = (3 + (1 if r is not None else 0)) * M * N * b
            cast = "gemma" if op == "layer_norm" else "llama"
            y, s, mean, rstd = F._norm_fwd(x, r, w, bias, op, 1e-6, 0.0, cast, True)
            xs = s if s is not None else x
            t_fwd = bench(lambda: F._norm_fwd(x, r, w, bias, op, 1e-6, 0.0, cast, False))
            t_full = bench(lambda: F._norm_bwd(xs, w, dy, dres, mean, rstd, op, 0.0, cast, True, True,
                                                bias is not None, dt, dt))
            t_frozen = bench(lambda: F._norm_bwd(xs, w, dy, dres, mean, rstd, op, 0.0, cast, True, False, False,
                                                  dt, dt))
            # torch eager reference points
            if op == "layer_norm":
                ef = lambda: torch.nn.functional.layer_norm(x, (N,), w, bias, 1e-6)  # noqa: E731
            elif op == "rms_norm":
                ef = lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6)  # noqa: E731
            else:
                ef = lambda: torch.nn.functional.rms_norm(x + r, (N,), w, 1e-6)  # noqa: E731
            t_eager = bench(ef)
            for name, t, nbytes in (("fwd", t_fwd, fwd_bytes), ("bwd_full", t_full, bwd_bytes),
                                    ("bwd_frozen", t_frozen, bwd_bytes), ("eager_fwd", t_eager, fwd_bytes)):
                tb = nbytes / (t * 1e-6) / 1e12
                rows.append((op, dt_name, shape, name, t, tb, 100 * tb / COPY))
                print(f"{op:20s} {dt_name:9s} {shape:11s} {name:11s} {t:9.1f} us {tb:6.2f} TB/s {100*tb/COPY:5.1f}%",
                      flush=True)
            del x, r, w, bias, dy, dres, y, s, mean, rstd, xs
            torch.cuda.empty_cache()
