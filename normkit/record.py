"""Launch records: which kernel variant ran, on what grid, with which buffers.

    >>> with normkit.record_launches() as log:
    ...     y = torch_frontend.rms_norm(x, w)
    >>> log[0].kernel, log[0].flags["STORE_STATS"]

Under ``jax.jit`` a launch is recorded when it is traced, since that is when the variant is chosen.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the launcher issued it."""

    kernel: str  # the kernel's function name (the @triton.jit or Pallas kernel; "xla_norm_fwd"/"xla_norm_bwd")
    frontend: str  # "torch", "jax-gpu" or "jax-cpu"
    grid: tuple[int, ...]
    num_warps: int
    flags: dict  # every constexpr the kernel was specialized with
    partial_buffers: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) of fp32 partials
    interpreted: bool  # ran in an interpreter (Triton's, or Pallas's interpret mode) rather than compiled
    implementation: str = "triton"  # "triton", "pallas" or "xla": which implementation of the op ran

    @property
    def partial_bytes(self) -> int:
        total = 0
        for _, shape, _ in self.partial_buffers:
            n = 4
            for d in shape:
                n *= d
            total += n
        return total


class LaunchLog(list):
    """The launches recorded inside one ``record_launches()`` block, in order."""

    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self]

    def of(self, kernel: str) -> list[Launch]:
        return [launch for launch in self if launch.kernel == kernel]


_ACTIVE: list[LaunchLog] = []


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchLog]:
    """Record every normkit kernel launch, from either frontend, made inside the block."""
    log = LaunchLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        # by identity: an enclosing block's log holds what this one holds, so it can compare equal
        del _ACTIVE[next(i for i, active in enumerate(_ACTIVE) if active is log)]


def emit(launch: Launch) -> None:
    for log in _ACTIVE:
        log.append(launch)


def active() -> bool:
    return bool(_ACTIVE)
