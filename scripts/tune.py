"""Launch-configuration sweep on a CUDA GPU (kernel-only, do_bench medians), plus a host-overhead
breakdown. Prints the best configuration per (op, mode, dtype, shape); feeds normkit.launch."""
import dataclasses
import itertools
import sys
import time

import torch
import triton.testing

from normkit import launch as plans
from torch_frontend import _launch
from torch_frontend import functional as F

dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def variant(call, block_m, warps, mult, stages, **extra):
    M = call.scalars[[n for n, _ in call.scalars].index("M")][1]
    tiles = -(-M // block_m)
    grid = tiles if mult == 0 else min(tiles, mult * SMS)
    c = dict(call.constexprs, BLOCK_M=block_m, LOOP_STAGES=stages, **extra)
    specs = dict(call.out_specs)
    for k in ("DW_PART", "DB_PART"):
        if k in specs:
            specs[k] = ((grid, specs[k][0][1]), "float32")
    return dataclasses.replace(call, grid=(grid,), num_warps=warps, constexprs=c, out_specs=specs)


def copy_tbps():
    a = torch.empty(2**30, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    return 4 * a.numel() / (bench(lambda: b.copy_(a)) * 1e-6) / 1e12


COPY = copy_tbps()
print(f"copy {COPY:.2f} TB/s, {SMS} SMs", flush=True)

SHAPES = [tuple(map(int, s.split("x"))) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                   "8192x8192,32768x4096,65536x2048,4096x1024").split(",")]
for (M, N), op, dt in itertools.product(SHAPES, ("rms_norm", "layer_norm"), (torch.bfloat16,)):
    b = dt.itemsize
    x = torch.randn(M, N, device=dev, dtype=dt)
    w = torch.randn(N, device=dev, dtype=dt)
    bias = torch.randn(N, device=dev, dtype=dt) if op == "layer_norm" else None
    dy = torch.randn(M, N, device=dev, dtype=dt)
    cast = "gemma" if op == "layer_norm" else "llama"
    _, _, mean, rstd = F._norm_fwd(x, None, w, bias, op, 1e-6, 0.0, cast, True)
    arrays = {"X": x, "W": w, "B": bias, "DY": dy, "MEAN": mean, "RSTD": rstd}
    dn = _launch.dtype_name(dt)
    fwd = plans.plan_forward(op=op, M=M, N=N, x_dtype=dn, has_w=True, has_b=bias is not None, eps=1e-6,
                             casting=cast, store_stats=False)
    bwd_frozen = plans.plan_backward(op=op, M=M, N=N, x_dtype=dn, has_w=True, has_dres=False, casting=cast,
                                     compute_dx=True, compute_dw=False, compute_db=False, num_sms=SMS)
    bwd_full = plans.plan_backward(op=op, M=M, N=N, x_dtype=dn, has_w=True, has_dres=False, casting=cast,
                                   compute_dx=True, compute_dw=True, compute_db=bias is not None, num_sms=SMS)
    bn = plans._next_pow2(N)
    bms = [1] if bn >= 4096 else [max(1, 4096 // bn // 2), 4096 // bn, 8192 // bn]
    for mode, base, nbytes in (("fwd", fwd, 2 * M * N * b), ("bwd_frozen", bwd_frozen, 3 * M * N * b),
                               ("bwd_full", bwd_full, 3 * M * N * b)):
        results = []
        if mode == "bwd_full":
            cands = [(bm, wp, mult, st) for bm in bms for wp in (4, 8, 16) for mult in (1, 2, 3) for st in (2, 3, 4)]
        else:
            cands = [(bm, wp, 0, 1) for bm in bms for wp in (4, 8, 16)]
            cands += [(bm, wp, mult, st) for bm in bms[:2] for wp in (4, 8, 16) for mult in (2, 4) for st in (2, 3)]
        if mode == "fwd" and op == "layer_norm":
            cands = [c + (wf,) for c in cands for wf in (False, True)]
        else:
            cands = [c + (False,) for c in cands]
        for bm, wp, mult, st, wf in cands:
            if bm * bn // (32 * wp) < 1:
                continue
            call = variant(base, bm, wp, mult, st, **({"WELFORD": True} if wf else {}))
            try:
                def go(call=call):
                    out = _launch.run(call, arrays, dev)
                    red = plans.plan_reduce(call, w_dtype=dn, b_dtype=dn if bias is not None else None)
                    if red is not None:
                        _launch.run(red, out, dev)
                t = bench(go)
            except Exception as e:  # a config that does not compile (e.g. out of shared memory)
                print(f"  {op} {mode} {M}x{N} bm={bm} w={wp} mult={mult} st={st}: {type(e).__name__}", flush=True)
                continue
            results.append((t, bm, wp, mult, st, wf))
        results.sort()
        t0 = results[0]
        tb = nbytes / (t0[0] * 1e-6) / 1e12
        print(f"{op:11s} {mode:10s} {M}x{N} best {t0[0]:7.1f} us ({100 * tb / COPY:5.1f}% copy) bm={t0[1]} "
              f"w={t0[2]} mult={t0[3]} st={t0[4]} welford={t0[5]} | top4 " +
              " ".join(f"{r[0]:.1f}:{r[1]}/{r[2]}/{r[3]}/{r[4]}/{'W' if r[5] else '-'}" for r in results[:4]),
              flush=True)
    del x, w, bias, dy, mean, rstd, arrays
    torch.cuda.empty_cache()

# Host overhead: tiny shape, CPU-timed loop of many calls.
x = torch.randn(4, 128, device=dev, dtype=torch.bfloat16)
w = torch.randn(128, device=dev, dtype=torch.bfloat16)


def host(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


call = plans.plan_forward(op="rms_norm", M=4, N=128, x_dtype="bfloat16", has_w=True, has_b=False, eps=1e-6,
                          casting="llama", store_stats=False)
y = torch.empty_like(x)
args = [x, None, w, None, 1e-6, 0.0, 4, 128, 128, 128, y, None, None, None]
print(f"host us/call: raw kernel[grid] {host(lambda: plans.norm_fwd_kernel[call.grid](*args, **call.constexprs, num_warps=call.num_warps, num_stages=1)):.1f}"
      f" | plan_forward {host(lambda: plans.plan_forward(op='rms_norm', M=4, N=128, x_dtype='bfloat16', has_w=True, has_b=False, eps=1e-6, casting='llama', store_stats=False)):.1f}"
      f" | _norm_fwd {host(lambda: F._norm_fwd(x, None, w, None, 'rms_norm', 1e-6, 0.0, 'llama', False)):.1f}"
      f" | rms_norm {host(lambda: F.rms_norm(x, w)):.1f}"
      f" | eager F.rms_norm {host(lambda: torch.nn.functional.rms_norm(x, (128,), w, 1e-6)):.1f}", flush=True)
xg = x.clone().requires_grad_(True)
wg = w.clone()
dy = torch.randn_like(x)
def fb():
    y = F.rms_norm(xg, wg)
    torch.autograd.grad(y, xg, dy)
def fbe():
    y = torch.nn.functional.rms_norm(xg, (128,), wg, 1e-6)
    torch.autograd.grad(y, xg, dy)
print(f"host us fwd+bwd frozen: normkit {host(fb, 500):.1f} eager {host(fbe, 500):.1f}", flush=True)
import cProfile
import pstats

cProfile.run("for _ in range(300): fb()", "/tmp/fb.prof")
pstats.Stats("/tmp/fb.prof").sort_stats("tottime").print_stats(14)
