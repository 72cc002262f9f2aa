"""Timers.

Two ways to time, named in every record (``timer``):

- ``do_bench``: ``triton.testing.do_bench(..., return_mode="median")``; one CUDA-event pair around
  each call with the L2 flushed before it. This is device time; host work shorter than the flush
  hides behind it. Used for normkit's bare kernel launches (path ``kernel``) and the copy.
- ``loop``: back-to-back calls, synchronized once per batch, wall clock; the median over batches of
  the per-call time. A call costs max(host time, device time), so host overhead shows where it
  dominates (small shapes) and device time where it does not. Used for every frontend call
  (path ``e2e``), Torch and JAX alike: JAX dispatches asynchronously, so timing it call by call
  would add a host sync to each call.

In both, callers rotate through several input sets when one set is smaller than ``ROTATE_BYTES``,
so consecutive calls do not find their inputs in the 60 MB L2.

``DryTimer`` replaces both with ``time.perf_counter`` medians of a few calls, for ``--dry-run`` on CPU.
"""
from __future__ import annotations

import statistics
import time

ROTATE_BYTES = 200 * 2**20  # rotate input sets until the sets together exceed this
MAX_SETS = 16
COPY_BYTES = 2 * 2**30  # the copy benchmark moves a 2 GiB bf16 tensor


def num_sets(set_bytes: int, limit: int = ROTATE_BYTES) -> int:
    """How many input sets to rotate so that together they exceed ``limit`` (at most MAX_SETS)."""
    if set_bytes <= 0:
        return 1
    return max(1, min(MAX_SETS, -(-limit // set_bytes)))


class GpuTimer:
    name = "gpu"

    def __init__(self, warmup_ms: float, rep_ms: float, batches: int = 5):
        import torch
        import triton.testing

        self._torch = torch
        self._do_bench = triton.testing.do_bench
        self.warmup_ms, self.rep_ms, self.batches = warmup_ms, rep_ms, batches

    def kernel(self, fn) -> float:
        """Median device time of ``fn()`` in microseconds (do_bench, L2 flushed before each call)."""
        return 1e3 * float(self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))

    def loop(self, call, sync) -> float:
        """Median per-call wall time in microseconds of back-to-back ``call(i)``; ``sync(out)`` blocks."""
        return _loop(call, sync, self.warmup_ms, self.rep_ms, self.batches)

    def torch_sync(self, _out=None) -> None:
        self._torch.cuda.synchronize()

    def copy_bandwidth(self) -> dict:
        """A device-to-device copy of a 2 GiB bf16 tensor; read + write counted."""
        torch = self._torch
        n = COPY_BYTES // 2
        src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        src.uniform_()
        dst = torch.empty_like(src)
        us = self.kernel(lambda: dst.copy_(src))
        moved = 2 * COPY_BYTES
        del src, dst
        torch.cuda.empty_cache()
        return {"what": "torch copy_ of 2 GiB bf16, device to device", "bytes": moved, "median_us": us,
                "tbps": moved / (us * 1e-6) / 1e12, "timer": "do_bench"}


class DryTimer:
    """perf_counter medians of a few calls: exercises the code paths on CPU, says nothing about speed."""

    name = "dry"

    def __init__(self, reps: int = 2):
        self.reps = reps  # callers have already run each function once (compiles, first-call work)

    def kernel(self, fn) -> float:
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    def loop(self, call, sync) -> float:
        times = []
        for i in range(self.reps):
            t0 = time.perf_counter()
            sync(call(i))
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    def torch_sync(self, _out=None) -> None:
        pass

    def copy_bandwidth(self) -> dict:
        import torch

        n = 16 * 2**20  # 32 MiB of bf16 on the host
        src = torch.ones(n, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        us = self.kernel(lambda: dst.copy_(src))
        moved = 2 * 2 * n
        return {"what": "torch copy_ of 32 MiB bf16 on the CPU (dry run)", "bytes": moved, "median_us": us,
                "tbps": moved / (us * 1e-6) / 1e12, "timer": "perf_counter"}


def _loop(call, sync, warmup_ms: float, rep_ms: float, batches: int) -> float:
    out = call(0)
    sync(out)
    # Warm up: at least warmup_ms and a few calls.
    n, t0 = 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - t0) * 1e3 < warmup_ms:
        out = call(n)
        n += 1
    sync(out)
    # Estimate one call (synchronized) to size the batches.
    t0 = time.perf_counter()
    for i in range(3):
        out = call(i)
    sync(out)
    est_ms = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    per_batch = max(3, min(2000, int(rep_ms / batches / est_ms)))
    times = []
    for _ in range(batches):
        sync(out)
        t0 = time.perf_counter()
        for i in range(per_batch):
            out = call(i)
        sync(out)
        times.append((time.perf_counter() - t0) / per_batch)
    return 1e6 * statistics.median(times)
