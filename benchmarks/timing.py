"""Timing, one module for the benchmarks, the scripts and the notebooks (benchmarks/README.md, "Timers").

``Timer.kernel``: device time, ``triton.testing.do_bench`` median with the L2 flushed before each call.
``Timer.device``: the GPU's own time per call, the summed durations of the kernels and copies a call
launches (``torch.profiler``, CUDA activity alone), host time excluded.
``Timer.loop``: wall time per call of back-to-back calls, ``torch.utils.benchmark.Timer`` blocks each
synchronized once at its end (``sync(last output)``), the median over ``batches`` blocks; a call costs
max(host, device). ``Timer.each``: the wall time of every call, each synchronized before and after.
``copy_bandwidth``: the device-to-device copy every "% of copy" divides by. ``num_sets``: how many input
sets to rotate so that consecutive calls do not find their inputs in the L2. ``Timer(dry=True)``: on a
CPU, one call per measurement by the wall clock, which says nothing about speed.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

ROTATE_BYTES = 200 * 2**20  # rotate input sets until the sets together exceed this
MAX_SETS = 16
COPY_BYTES = 2 * 2**30  # the copy moves a 2 GiB bf16 tensor on the GPU
DRY_COPY_BYTES = 32 * 2**20  # and 32 MiB on the host in a dry run


def num_sets(set_bytes: int, limit: int = ROTATE_BYTES) -> int:
    """How many input sets to rotate so that together they exceed ``limit`` (at most MAX_SETS)."""
    if set_bytes <= 0:
        return 1
    return max(1, min(MAX_SETS, -(-limit // set_bytes)))


def tbps(nbytes: int, us: float) -> float:
    """Terabytes per second of ``nbytes`` moved in ``us`` microseconds."""
    return nbytes / (us * 1e-6) / 1e12


def torch_sync(_out=None) -> None:
    """Wait for the GPU (when torch has one): the ``sync`` of Torch calls."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclasses.dataclass(frozen=True)
class Timer:
    """How long to warm up and to measure (``warmup_ms``, ``rep_ms`` over ``batches`` blocks)."""

    warmup_ms: float = 5.0
    rep_ms: float = 20.0
    batches: int = 5
    dry: bool = False

    @property
    def name(self) -> str:
        return "dry" if self.dry else "gpu"

    def kernel(self, fn) -> float:
        """Median device time of ``fn()`` in µs (do_bench; a dry run: one call's wall time)."""
        if self.dry:
            return self.loop(lambda _: fn(), lambda _: None)
        import triton.testing

        return 1e3 * float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))

    def device(self, fn, calls: int = 20, batches: int = 3) -> float | None:
        """Median over ``batches`` of the device time in µs of one ``fn()``: the summed durations of every
        GPU activity (kernels, copies, fills) that ``calls`` back-to-back calls launch, over ``calls``.
        Host time is left out: what a call costs the GPU when the host keeps up. None in a dry run."""
        if self.dry:
            return None
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(batches):
            with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:  # one batch: no cycles to clear
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            gpu = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA]
            if not gpu:
                raise RuntimeError("Timer.device: the profiler recorded no GPU activity")
            per_call.append(sum(gpu) / calls)
        return float(statistics.median(per_call))

    def loop(self, call, sync) -> float:
        """Median per-call wall time in µs of back-to-back ``call(i)`` (i = 0, 1, ...: the input set
        to use); ``sync(out)`` waits for ``out``, the last call's result, at each block's end."""
        import torch
        import torch.utils.benchmark as tb

        state = {"i": 0, "out": None}

        def step():
            state["out"] = call(state["i"])
            state["i"] += 1

        def clock() -> float:  # Timer reads it before and after a block: the block ends synchronized
            if state["out"] is not None:
                sync(state["out"])
            return time.perf_counter()

        timer = tb.Timer("step()", globals={"step": step}, timer=clock, num_threads=torch.get_num_threads())
        if self.dry:
            return 1e6 * timer.timeit(1).median
        first = timer.timeit(3).median  # after Timer's 2 warm-up calls: an estimate of one call
        if self.warmup_ms > 0:
            timer.timeit(max(3, int(self.warmup_ms * 1e-3 / first)))
        number = max(3, min(2000, int(self.rep_ms * 1e-3 / self.batches / first)))
        return 1e6 * statistics.median(timer.timeit(number).median for _ in range(self.batches))

    @staticmethod
    def each(fn, n: int, sync) -> list[float]:
        """Wall time in µs of each of ``n`` calls of ``fn()``, with ``sync(out)`` before and after each."""
        times, out = [], None
        for _ in range(n):
            sync(out)
            t0 = time.perf_counter()
            out = fn()
            sync(out)
            times.append((time.perf_counter() - t0) * 1e6)
        return times

    def copy_bandwidth(self) -> dict:
        """A device-to-device ``copy_`` of 2 GiB of bf16 (a dry run: 32 MiB on the host), read and
        write counted, timed as ``kernel`` times."""
        import torch

        nbytes = DRY_COPY_BYTES if self.dry else COPY_BYTES
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cpu" if self.dry else "cuda").uniform_()
        dst = torch.empty_like(src)
        us = self.kernel(lambda: dst.copy_(src))
        del src, dst
        if not self.dry:
            torch.cuda.empty_cache()
        where = "on the CPU (dry run)" if self.dry else "device to device"
        return {"what": f"torch copy_ of {nbytes / 2**20:g} MiB bf16, {where}", "bytes": 2 * nbytes,
                "median_us": us, "tbps": tbps(2 * nbytes, us),
                "timer": "wall clock (dry run)" if self.dry else "do_bench"}
