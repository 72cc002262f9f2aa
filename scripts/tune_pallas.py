"""Launch-configuration sweep of the Pallas kernels (``normkit/kernels/norm_pallas.py``), timed on a GPU.

The Pallas launches take their shape from ``normkit.launch.pallas_blocks`` (rows per tile, warps,
grid, tiles per program). This sweep swaps that choice for variants around it, one jitted program
per variant, and times each through ``jax_frontend._pallas`` exactly as the frontend launches it:

- ``fwd``: the inference forward; variants of BLOCK_M, num_warps, and one program per tile or a
  persistent grid of 1, 2 or 4 programs per SM;
- ``bwd_full``: dx and dW (and dB), with the partial reduction; variants of num_warps and the
  persistent grid (1 or 2 programs per SM: the number of fp32 partial rows follows it);
- ``bwd_frozen``: dx only; variants of BLOCK_M, num_warps, and one program per tile or a
  persistent grid (as the forward).

Every variant's outputs are checked against the base configuration's (within the tolerance table;
a variant that disagrees is reported and not ranked). On a GPU, times are ``benchmarks.timing.Timer.loop``
medians (blocks of back-to-back calls, one synchronization per block: the GPU queue stays full, so the
time is the device's), with bandwidth under ``benchmarks/bytemodel.py`` as a share of the device copy
of ``Timer.copy_bandwidth``. ``--dry-run`` (CPU, Pallas interpret mode): a tiny shape, each variant launched and
checked once, nothing timed.

    python scripts/tune_pallas.py [--shapes 8192x8192] [--ops layer_norm] [--modes fwd] [--dtypes bfloat16]
    python scripts/tune_pallas.py --dry-run
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bytemodel  # noqa: E402
from benchmarks.timing import Timer, tbps  # noqa: E402
from jax_frontend import _pallas  # noqa: E402
from normkit import record  # noqa: E402
from normkit.launch import PallasBlocks  # noqa: E402
from normkit.ops import OPS, Grads, Op  # noqa: E402
from normkit.shapes import parse_list  # noqa: E402
from normkit.testing import TOLERANCES  # noqa: E402

MODES = tuple(m for m in bytemodel.MODES if m != "fwd_bwd")
DEFAULT_SHAPES = "8192x8192,16384x8192,32768x4096"
DRY_RUN_SHAPES = "24x256"
WARPS = (4, 8, 16, 32)


def base_blocks(op: Op, mode: str, M: int, N: int, dtype: str) -> PallasBlocks:
    """What ``jax_frontend._pallas`` launches today."""
    return _pallas.blocks(op, M, N, dtype, backward=mode != "fwd", reduces=mode == "bwd_full")


def variants(op: Op, mode: str, M: int, N: int, num_sms: int, dtype: str) -> list[PallasBlocks]:
    """The base configuration first, then the distinct variants around it."""
    base = base_blocks(op, mode, M, N, dtype)
    found = [base]
    block_n = base.block_n
    rows = sorted({base.block_m, *(b for b in (1, 2, 4, 8, 16) if b * block_n <= 32768 and b <= max(M, 1))})
    for block_m in rows if mode != "bwd_full" else [base.block_m]:
        tiles = -(-M // block_m)
        if mode == "bwd_full":
            grids = sorted({base.num_programs, *(min(tiles, k * num_sms) for k in (1, 2))})
        else:  # one program per tile, or a persistent grid of 1, 2 or 4 programs per SM
            grids = [tiles, *(min(tiles, k * num_sms) for k in (1, 2, 4))]
        for warps in WARPS:
            if block_m * block_n < 32 * warps:  # fewer than one element per thread
                continue
            for programs in grids:
                cfg = PallasBlocks(block_m, block_n, warps, programs, -(-tiles // programs), base.num_stages)
                if cfg not in found:
                    found.append(cfg)
    return found


def label(cfg: PallasBlocks) -> str:
    grid = f"grid {cfg.num_programs}" + (f" x {cfg.tiles_per_program} tiles" if cfg.tiles_per_program > 1 else "")
    return f"BLOCK_M {cfg.block_m:2d}, {cfg.num_warps:2d} warps, {grid}"


def launcher(op: Op, mode: str):
    """The Pallas implementation's call for ``mode``, as the frontend makes it: ``fwd(x, r, w, b)``
    or ``bwd(x, w, dy, dres, mean, rstd)``, each returning the dict of its outputs. ``dres``, the
    gradient of the fused add's residual output, is what a training step passes (None otherwise)."""
    opts = op.options(eps=op.default_eps)
    if mode == "fwd":
        return lambda x, r, w, b: _pallas.forward(op, x, r, w, b, opts=opts, store_stats=False)
    grads = Grads(dx=True, dw=mode == "bwd_full", db=mode == "bwd_full" and "bias" in op.params)
    return lambda x, w, dy, dres, mean, rstd: _pallas.backward(
        op, x, w, dy, dres, mean, rstd, opts=opts, grads=grads, b_dtype="float32" if "bias" in op.params else None)


def program(op: Op, mode: str, cfg: PallasBlocks):
    """A freshly jitted launch of ``mode`` under the launch shape ``cfg`` (read when it is traced)."""

    def fixed(*_, **__):
        return cfg

    def traced(fn):
        def run(*args):
            saved = _pallas.pallas_blocks
            _pallas.pallas_blocks = fixed
            try:
                return fn(*args)
            finally:
                _pallas.pallas_blocks = saved
        return jax.jit(run)

    return traced(launcher(op, mode))


def inputs(op: Op, M: int, N: int, dtype: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rand = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)  # noqa: E731
    a = {"x": rand(M, N), "r": rand(M, N) if op.has_residual else None, "w": rand(N),
         "b": rand(N) if "bias" in op.params else None, "dy": rand(M, N),
         "dres": rand(M, N) if op.has_residual else None}
    opts = op.options(eps=op.default_eps)
    stats = _pallas.forward(op, a["x"], a["r"], a["w"], a["b"], opts=opts, store_stats=True)
    a["s"] = stats.get("S", a["x"])  # what the backward normalizes
    a["mean"], a["rstd"] = stats.get("MEAN"), stats["RSTD"]
    return a


def args_of(mode: str, a: dict) -> tuple:
    if mode == "fwd":
        return a["x"], a["r"], a["w"], a["b"]
    return a["s"], a["w"], a["dy"], a["dres"], a["mean"], a["rstd"]


def agree(out: dict, base: dict, dtype: str) -> bool:
    tol = TOLERANCES[dtype]
    rtol, atol = 4 * tol["rtol"], 4 * tol["atol"]
    for name, want in base.items():
        got = np.asarray(out[name], dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if not np.allclose(got, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max()))):
            return False
    return True


def sweep(op: Op, mode: str, dtype: str, M: int, N: int, num_sms: int, *, dry: bool, timer: Timer,
          copy: float | None, top: int) -> None:
    a = inputs(op, M, N, dtype, seed=0)
    args = args_of(mode, a)
    cfgs = variants(op, mode, M, N, num_sms, dtype)
    base_out = None
    rows = []
    for i, cfg in enumerate(cfgs):
        fn = program(op, mode, cfg)
        with record.record_launches() as log:
            out = fn(*args)
        main_launch = log[0]  # the row kernel (a full backward's reduction follows it)
        if main_launch.grid != (cfg.num_programs,) or main_launch.num_warps != cfg.num_warps:
            raise RuntimeError(f"{label(cfg)}: the launch ran grid {main_launch.grid}, {main_launch.num_warps} warps")
        if base_out is None:
            base_out = out
        elif not agree(out, base_out, dtype):
            print(f"  {label(cfg)}: DISAGREES with the base configuration (not ranked)")
            continue
        rows.append((None if dry else timer.loop(lambda _, fn=fn: fn(*args), jax.block_until_ready), i, cfg))
        if not dry:  # as it goes: a run cut short by a time limit still says what it measured
            print(f"  measured {rows[-1][0]:8.1f} us  {label(cfg)}", flush=True)
    what = f"{op.name} {mode} {dtype} {M}x{N}"
    if dry:
        print(f"{what}: {len(rows)}/{len(cfgs)} variants launched as configured, all within tolerance of the base")
        return
    nbytes = bytemodel.bytes_moved(op.name, mode, M, N, bytemodel.itemsize(dtype))
    rows.sort(key=lambda r: r[0])
    base_us = next(us for us, i, _ in rows if i == 0)

    def fmt(us, cfg):
        bw = tbps(nbytes, us)
        return f"{us:8.1f} us  {bw:5.2f} TB/s ({100 * bw / copy:3.0f}% of copy)  {label(cfg)}"

    print(f"{what}: base {fmt(base_us, cfgs[0])}")
    for us, i, cfg in rows[:top + 1]:
        print(f"    {'base ' if i == 0 else '     '}{fmt(us, cfg)}  ({base_us / us:4.2f}x the base)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help=f"MxN,... (default {DEFAULT_SHAPES}; dry run {DRY_RUN_SHAPES})")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--rep-ms", type=float, default=25.0, help="milliseconds timed per variant, over 5 blocks")
    p.add_argument("--top", type=int, default=4, help="configurations listed after the best")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpret mode, a tiny shape, nothing timed")
    args = p.parse_args(argv)
    dry = args.dry_run or jax.default_backend() == "cpu"
    shapes = parse_list(args.shapes or (DRY_RUN_SHAPES if dry else DEFAULT_SHAPES))
    num_sms = _pallas.num_sms()
    timer = Timer(rep_ms=args.rep_ms)
    copy = None if dry else timer.copy_bandwidth()["tbps"]
    print(f"backend {jax.default_backend()}, {num_sms} SMs" + ("" if dry else f", copy {copy:.2f} TB/s"))
    for M, N in shapes:
        for dtype in args.dtypes.split(","):
            for name in args.ops.split(","):
                for mode in args.modes.split(","):
                    sweep(OPS[name], mode, dtype, M, N, num_sms, dry=dry, timer=timer, copy=copy, top=args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
