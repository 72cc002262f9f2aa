"""Where the host time of one eager RMSNorm call goes: each piece of normkit's fast path timed alone.

``benchmarks/host_time.py`` times whole calls against the peers; this script takes normkit's
repeated-call path (``torch_frontend/_fastpath.py``, ``_autograd.BoundRMSNorm``, ``_backend._BoundLaunch``)
apart, in one process, so the pieces can be read against each other:

- the pieces of the forward: the key lookup, an allocation, the bound forward (allocations + launch),
  the C launch alone (``_DirectLaunch``, on CUDA), the op's autograd Function, the public call, and
  the public call without a gradient to come (inference: no Function);
- the pieces of the backward: the bound backward (the key of its layouts + allocation + launch), and
  a ladder of ``autograd.Function`` floors that add one of the backward's costs at a time (allocate
  only; also save and unpack the four tensors the op saves; also keep a Python object on ``ctx``),
  each through ``torch.autograd.grad`` as a training loop calls it;
- the eager peer (``F.rms_norm``) and one ATen op (``x.mul(1)``) through the same calls.

Each row: median over blocks of calls (one synchronization per block) of the time per call, µs.
``--profile`` adds cProfile's ranking of the fwd + grad loop. Private internals are used on purpose:
the script follows this checkout's fast path (it is not a before/after harness).

    python benchmarks/host_parts.py [--shape 4096x1024] [--dtype bfloat16] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_frontend as tf  # noqa: E402
from benchmarks.timing import torch_sync  # noqa: E402
from normkit.ops import RMS_NORM  # noqa: E402
from normkit.shapes import parse  # noqa: E402
from torch_frontend import _autograd, _fastpath  # noqa: E402


class _AllocOnly(torch.autograd.Function):
    """Allocates the output and dx; launches nothing (``host_time.py``'s floor, frozen weight)."""

    @staticmethod
    def forward(ctx, x, weight):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy), None


class _SavesFour(torch.autograd.Function):
    """Also saves what ``BoundRMSNorm`` saves (x, weight, a per-row buffer twice) and unpacks it."""

    @staticmethod
    def forward(ctx, x, weight):
        stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(x, weight, stats, stats)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        ctx.saved_tensors
        return torch.empty_like(dy), None


class _SavesFourAndObject(_SavesFour):
    """Also keeps a Python object on ``ctx`` and reads ``needs_input_grad``, as ``BoundRMSNorm`` does."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.bound = weight
        return _SavesFour.forward(ctx, x, weight)

    @staticmethod
    def backward(ctx, dy):
        ctx.needs_input_grad, ctx.bound
        return _SavesFour.backward(ctx, dy)


def per_call_us(fn, calls: int, blocks: int) -> float:
    for _ in range(max(calls // 4, 1)):
        fn()
    torch_sync()
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch_sync()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def pieces(x, w, dy) -> dict:
    """name -> a call of one piece (RMSNorm, frozen weight, x requires grad)."""
    xd = x.detach()
    tf.rms_norm(x, w)  # binds the call signature
    _, bound = _fastpath.lookup(RMS_NORM, 1e-6, 0.0, "llama", x, None, w, None)
    if bound is None:
        raise SystemExit("the call was not bound: no fast path for this layout")
    _, _, mean, rstd = bound.forward(x, None, w, None)
    out = {
        "lookup (key + dict)": lambda: _fastpath.lookup(RMS_NORM, 1e-6, 0.0, "llama", x, None, w, None),
        "torch.empty_like": lambda: torch.empty_like(xd),
        "bound forward (allocs + launch)": lambda: bound.forward(x, None, w, None),
    }
    launch = bound.forward
    if getattr(launch, "direct", None) is not None:  # CUDA, compiled for aligned pointers
        outs = [t.data_ptr() if t is not None else None for t in launch(xd, None, w, None)]
        ins = [xd.data_ptr(), None, w.data_ptr(), None]
        stream = torch._C._cuda_getCurrentRawStream(x.device.index)
        out["C launch alone"] = lambda: launch.direct(stream, ins, outs)
    out.update({
        "bound backward dx (key + alloc + launch)": lambda: bound.backward(xd, w, dy, None, mean, rstd,
                                                                          (True, False, False)),
        "BoundRMSNorm.apply": lambda: _autograd.BoundRMSNorm.apply(bound, x, w),
        "tf.rms_norm, grad mode": lambda: tf.rms_norm(x, w),
        "F.rms_norm, grad mode": lambda: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    })
    tf.rms_norm(xd, w)  # binds the inference signature (x without grad: no Function, no statistics)
    out.update({
        "tf.rms_norm, inference": lambda: tf.rms_norm(xd, w),
        "F.rms_norm, inference": lambda: F.rms_norm(xd, (x.shape[-1],), w, 1e-6),
    })
    grad = torch.autograd.grad
    out.update({
        "fwd+grad: floor (allocate only)": lambda: grad(_AllocOnly.apply(x, w), x, dy),
        "fwd+grad: floor + 4 saved tensors": lambda: grad(_SavesFour.apply(x, w), x, dy),
        "fwd+grad: floor + saved + ctx object": lambda: grad(_SavesFourAndObject.apply(x, w), x, dy),
        "fwd+grad: normkit": lambda: grad(tf.rms_norm(x, w), x, dy),
        "fwd+grad: F.rms_norm": lambda: grad(F.rms_norm(x, (x.shape[-1],), w, 1e-6), x, dy),
        "fwd+grad: x.mul(1)": lambda: grad(x.mul(1), x, dy),
    })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=200, help="calls per block")
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--profile", action="store_true", help="also cProfile's top 25 of the normkit fwd+grad loop")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    m, n = parse(args.shape)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = torch.rand(n, device=device, dtype=dtype, generator=gen) + 0.5
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
    print(f"host µs per call, RMSNorm {args.shape} {args.dtype} on {device}, frozen weight "
          f"(median of {args.blocks} blocks of {args.calls} calls)", flush=True)
    parts = pieces(x, w, dy)
    for name, fn in parts.items():
        print(f"  {name:44s} {per_call_us(fn, args.calls, args.blocks):9.2f}", flush=True)
    if args.profile:
        prof, fn = cProfile.Profile(), parts["fwd+grad: normkit"]
        prof.enable()
        for _ in range(args.calls * args.blocks):
            fn()
        prof.disable()
        torch_sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
