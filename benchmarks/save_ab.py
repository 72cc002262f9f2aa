"""What a frozen norm keeps, the input or the output, side by side in one process: at every cell of the
Torch table (``report.CELL_SHAPES``) and at QK-norm rows (262144 x 128), for each op.

Per cell, in interleaved rounds (input, output, input, output, ...; the median of the rounds' medians):

- ``kernel``: device time of normkit's frozen backward as the frontend launches it (``normkit.driver``):
  from the saved input, and from the saved output (``from_output``, the weight's recovery after the
  statistics); and of the training forward without and with that recovery (program 0's extra work);
- ``e2e``: the frozen backward through ``torch.autograd.grad``, ``save="input"`` against the default
  ``save="auto"`` (which keeps the output: checked);
- ``jax``: the frozen forward and backward under ``jax.jit`` as a network issues them (the forward's vjp,
  then the backward, jitted apart), normkit (``save="auto"``) against XLA's own autodiff of a jnp
  expression.

The byte model is ``bytemodel.backward_terms(frozen=True)`` for both backwards (x or y read once: the
same bytes). Writes ``--out`` (JSON) and a Markdown table beside it. ``--dry-run``: one tiny shape
through Triton's interpreter, numbers that mean nothing. ``--host-ab``: host time of an eager forward
and frozen backward at 4096 x 1024 bf16 under each of ``torch_frontend._backend.LAUNCH``'s launch
paths, interleaved blocks in one process. ``--only op:dtype:MxN[,...]``: those cells alone; ``--tiles w1,m*``: with ``--sweep``,
those tiles alone (``*``: any whose names start so).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks import bytemodel  # noqa: E402
from benchmarks.env import versions  # noqa: E402
from benchmarks.timing import Timer, num_sets, tbps, torch_sync  # noqa: E402

QK_ROWS = ("bf16", "262144x128")


def _cells(ops, dry: bool, only=()):
    """``(op, dtype, (M, N))`` of every cell of ``ops`` (``only``: those named ``op:dtype:MxN``)."""
    from benchmarks import report

    if dry:
        return [(op, "bf16", (32, 256)) for op in ops]
    shapes = list(report.CELL_SHAPES) + [QK_ROWS]
    out = []
    for op in ops:
        for dtype, shape in shapes:
            if (dtype, shape) == QK_ROWS and op != "rms_norm":
                continue
            M, N = (int(v) for v in shape.split("x"))
            if not only or f"{op}:{dtype}:{shape}" in only:
                out.append((op, dtype, (M, N)))
    unknown = set(only) - {f"{op}:{dtype}:{M}x{N}" for op, dtype, (M, N) in out}
    if unknown:
        raise SystemExit(f"--only: no such cell {sorted(unknown)} (op:dtype:MxN, e.g. rms_norm:bf16:8192x8192)")
    return out


def _rounds(variants: dict, rounds: int) -> dict:
    """``{name: median over rounds}`` of ``variants`` (name -> a function returning µs), interleaved."""
    got = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            got[name].append(fn())
    return {name: statistics.median(v) for name, v in got.items()}


def torch_cell(op_name: str, dtype: str, M: int, N: int, timer: Timer, rounds: int, device) -> dict:
    import torch

    import normkit
    import torch_frontend as tf
    from benchmarks.impls_torch import EPS, TorchInputs
    from normkit import driver
    from normkit.ops import OPS, Grads
    from torch_frontend import backend

    op = OPS[op_name]
    s = bytemodel.itemsize(dtype)
    k = 1 if timer.dry else num_sets(bytemodel.input_set_bytes(op_name, M, N, s))
    inp = TorchInputs(op_name, M, N, dtype, device, k)
    w, b = inp.weight, inp.bias
    opts = op.options(eps=EPS[op_name])

    def fwd(i, rec):
        r = inp.residual[i % k] if inp.residual is not None else None
        return driver.forward(backend, op, inp.x[i % k], r, w, b, opts, True, rec, rec)

    saved = {rec: [fwd(i, rec) for i in range(k)] for rec in (False, True)}

    def bwd(i, from_output):
        y, s_, mean, rstd, _, _ = saved[from_output][i % k]
        rows = y if from_output else (s_ if op.has_residual else inp.x[i % k])
        dres = inp.ds[i % k] if inp.ds is not None else None
        return driver.backward(backend, op, rows, w, inp.dy[i % k], dres, mean, rstd, opts, Grads(True, False, False),
                               None, b if from_output else None, from_output)

    def kernel(fn):
        counter = iter(range(1, 1 << 62))
        return lambda: timer.kernel(lambda: fn(next(counter)))

    with normkit.record_launches() as log:
        bwd(0, True)
    assert log[0].flags["FROM_Y"], log[0].flags
    out = {"kernel_bwd": _rounds({"input": kernel(lambda i: bwd(i, False)), "output": kernel(lambda i: bwd(i, True))},
                                 rounds),
           "kernel_fwd": _rounds({"input": kernel(lambda i: fwd(i, False)), "output": kernel(lambda i: fwd(i, True))},
                                 rounds)}
    for v in (out["kernel_bwd"], out["kernel_fwd"]):
        v["ratio"] = v["output"] / v["input"]
    saved = None

    # through autograd: the backward alone, on graphs built beforehand (as benchmarks/bench.py's bwd_frozen)
    f = getattr(tf, op_name)

    def graphs(save):
        out = []
        for i in range(k):
            for t in (inp.x[i],) + ((inp.residual[i],) if inp.residual is not None else ()):
                t.requires_grad_(True)
            args = [inp.x[i]] + ([inp.residual[i]] if inp.residual is not None else []) + [w] + ([b] if b is not None
                                                                                                 else [])
            y = f(*args, EPS[op_name], save=save)
            out.append(y[0] if isinstance(y, tuple) else y)
        return out

    kept = {}
    for save in ("input", "auto"):
        with normkit.record_launches() as log:
            g = graphs(save)
            torch.autograd.grad(g[0], [inp.x[0]] + ([inp.residual[0]] if inp.residual is not None else []),
                                inp.dy[0], retain_graph=True)
        kept[save] = [launch.flags["FROM_Y"] for launch in log if launch.kernel == "norm_bwd_kernel"][0]
        inp_graphs = g

        def call(i, g=inp_graphs):
            wrt = [inp.x[i % k]] + ([inp.residual[i % k]] if inp.residual is not None else [])
            return torch.autograd.grad(g[i % k], wrt, inp.dy[i % k], retain_graph=True)
        kept[save + "_call"] = call
    assert not kept["input"] and kept["auto"], kept
    e2e = _rounds({"input": lambda: timer.loop(kept["input_call"], torch_sync),
                   "auto": lambda: timer.loop(kept["auto_call"], torch_sync)}, rounds)
    e2e["ratio"] = e2e["auto"] / e2e["input"]
    out["e2e_bwd"] = e2e
    nbytes = sum(bytemodel.backward_terms(op, M, N, s, s, frozen=True).values())
    out["bytes_bwd"] = nbytes
    out["kernel_bwd"]["tbps_output"] = tbps(nbytes, out["kernel_bwd"]["output"])
    return out


def sweep_configs(N: int) -> dict:
    """The output-saving backward's tiles to try at row length N: ``{name: (num_warps, CHUNK_N, programs
    per SM, LOOP_STAGES, BLOCK_M, PARAMS_PER_TILE)}`` (``normkit.launch._BWD_TILES``' values; BLOCK_M 0:
    tile_config's):
    tile_config's warps (``w1``) and twice as many (``w2``), each with one program per tile, in one pass
    and, for rows of >= 2048 columns, in two passes over half- and quarter-row chunks (``c<CHUNK_N>``);
    persistent grids (``p<programs per SM>s<stages>``): 1 or 2 programs per SM at 1, 2 and 4 times the
    warps, 3 or 4 at 1 and 2 times; and, for rows of >= 2048 columns, tiles of 2 and 4 rows
    (``m<rows>``) at as many times the warps and twice that, one program per tile; and each one-pass
    tile again with the parameters loaded in every tile (``<name>_t``: ``PARAMS_PER_TILE``)."""
    from normkit import launch

    _, block_n, warps = launch.tile_config(1, N)
    out = {}
    for scale in (1, 2):
        w = min(32, warps * scale)
        out[f"w{scale}"] = (w, 0, 0, 1, 0, 0)
        for chunk in (block_n // 2, block_n // 4) if block_n >= 2048 else ():
            out[f"w{scale}_c{chunk}"] = (w, chunk, 0, 1, 0, 0)
    for scale in (1, 2, 4):
        w = min(32, warps * scale)
        for per_sm in (1, 2):
            for stages in (1, 3):
                out.setdefault(f"w{w // warps}_p{per_sm}s{stages}", (w, 0, per_sm, stages, 0, 0))
    for scale in (1, 2):
        w = min(32, warps * scale)
        for per_sm in (3, 4):
            for stages in (2, 4):
                out.setdefault(f"w{w // warps}_p{per_sm}s{stages}", (w, 0, per_sm, stages, 0, 0))
    for rows in (2, 4) if block_n >= 2048 else ():
        for scale in (1, 2):
            w = min(32, warps * rows * scale)
            out.setdefault(f"m{rows}_w{w // warps}", (w, 0, 0, 1, rows, 0))
    out.update({f"{name}_t": (*tile[:5], 1) for name, tile in out.items() if not tile[1]})
    return out


@contextlib.contextmanager
def backward_tile(key: tuple, tile: tuple):
    """``normkit.launch``'s backward planned with ``tile`` (a ``_BWD_TILES`` value) at ``key`` (op,
    from_output, element bytes, BLOCK_N) inside the block, the table and its plans as before after it."""
    from normkit import launch

    planned = launch._BWD_TILES
    launch._BWD_TILES = {**planned, key: tile}
    launch.plan_backward.cache_clear()
    try:
        yield
    finally:
        launch._BWD_TILES = planned
        launch.plan_backward.cache_clear()


def sweep_cell(op_name: str, dtype: str, M: int, N: int, timer: Timer, tiles=()) -> dict:
    """Device time of the frozen backward from the input (its plan) and from the output at each of
    ``sweep_configs``' tiles (``tiles``: those named, ``m*``: those whose names start so), each set in
    ``normkit.launch._BWD_TILES`` for this op, dtype and row length, and as planned."""
    from benchmarks.impls_torch import EPS, TorchInputs
    from normkit import driver, launch
    from normkit.ops import ELEM_BYTES, OPS, Grads
    from torch_frontend import backend

    op = OPS[op_name]
    k = 1 if timer.dry else num_sets(bytemodel.input_set_bytes(op_name, M, N, bytemodel.itemsize(dtype)))
    inp = TorchInputs(op_name, M, N, dtype, "cpu" if timer.dry else "cuda", k)
    opts = op.options(eps=EPS[op_name])
    saved = {rec: [driver.forward(backend, op, inp.x[i], inp.residual[i] if inp.residual is not None else None,
                                  inp.weight, inp.bias, opts, True, rec, rec) for i in range(k)] for rec in (False, True)}

    def timed(from_output):
        counter = iter(range(1, 1 << 62))

        def call():
            i = next(counter) % k
            y, s_, mean, rstd, _, _ = saved[from_output][i]
            rows = y if from_output else (s_ if op.has_residual else inp.x[i])
            dres = inp.ds[i] if inp.ds is not None else None
            return driver.backward(backend, op, rows, inp.weight, inp.dy[i], dres, mean, rstd, opts,
                                   Grads(True, False, False), None, inp.bias if from_output else None, from_output)
        return timer.kernel(call)

    key = (op_name, True, ELEM_BYTES[str(inp.x[0].dtype).removeprefix("torch.")], launch.tile_config(1, N)[1])
    out = {"input": timed(False), "planned": None}
    for name, tile in sweep_configs(N).items():
        if tiles and not any(name == t or (t.endswith("*") and name.startswith(t[:-1])) for t in tiles):
            continue
        try:
            with backward_tile(key, tile):
                out[name] = timed(True)
        except Exception as e:  # a tile the device cannot run (shared memory, registers)
            print(f"{op_name} {dtype} {M}x{N} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    out["planned"] = timed(True)
    return out


def jax_cell(op_name: str, dtype: str, M: int, N: int, timer: Timer, rounds: int) -> dict:
    import jax

    import jax_frontend as jf
    from benchmarks.impls_jax import EPS, JaxInputs, Jitted, xla_fn

    s = bytemodel.itemsize(dtype)
    k = 1 if timer.dry else num_sets(bytemodel.input_set_bytes(op_name, M, N, s))
    inp = JaxInputs(op_name, M, N, dtype, k)
    f = getattr(jf, op_name)

    def nk(save):
        return (lambda *p: tuple(f(*p, EPS[op_name], save=save))) if op_name == "fused_add_rms_norm" else (
            lambda *p: (f(*p, EPS[op_name], save=save),))

    variants = {"xla": Jitted(op_name, xla_fn(op_name)), "auto": Jitted(op_name, nk("auto"))}

    def timed(j):
        fwd_train, bwd = j.fwd_train[True], j.bwd

        def call(i):
            return bwd(fwd_train(*inp.primals(i))[1], inp.cotangents(i))
        jax.block_until_ready(call(0))
        return lambda: timer.loop(call, jax.block_until_ready)

    out = _rounds({name: timed(j) for name, j in variants.items()}, rounds)
    out["ratio_auto_xla"] = out["auto"] / out["xla"]
    inp.free()
    return out


def host_ab(timer: Timer, blocks: int, calls: int, device) -> dict:
    """Per-call wall time of an eager RMSNorm forward + frozen backward (4096 x 1024 bf16) under each
    launch path, in interleaved blocks of ``calls`` calls; medians of the blocks."""
    import torch

    import torch_frontend as tf
    from torch_frontend import _backend, _bound

    M, N = (64, 256) if timer.dry else (4096, 1024)
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(N, device=device, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    times = {"triton": [], "direct": []}
    for block in range(blocks):
        for mode in (("triton", "direct") if block % 2 == 0 else ("direct", "triton")):
            _backend.LAUNCH = mode
            _bound.BOUND.clear()
            for _ in range(3):  # bind and warm
                torch.autograd.grad(tf.rms_norm(x, w), x, dy)
            torch_sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.autograd.grad(tf.rms_norm(x, w), x, dy)
            torch_sync()
            times[mode].append((time.perf_counter() - t0) / calls * 1e6)
    _backend.LAUNCH = "triton"
    _bound.BOUND.clear()
    med = {mode: statistics.median(v) for mode, v in times.items()}
    return {"us_per_call": med, "direct_over_triton": med["direct"] / med["triton"], "blocks": blocks, "calls": calls}


def trip_check(device) -> dict:
    """A frozen weight zeroed in one column behind torch's version counter (``w.data[3] = 0``) after a
    safe decision: that call's dx is NaN (the forward's recovery poisons it), and the next call keeps
    the input and is right."""
    import torch

    import torch_frontend as tf

    x = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.ones(256, device=device)
    dy = torch.randn(64, 256, device=device)
    torch.autograd.grad(tf.rms_norm(x, w), x, dy)
    w.data[3] = 0.0
    poisoned = torch.autograd.grad(tf.rms_norm(x, w), x, dy)[0]
    torch_sync()
    fixed = torch.autograd.grad(tf.rms_norm(x, w), x, dy)[0]
    want = torch.autograd.grad(tf.rms_norm(x, w, save="input"), x, dy)[0]
    return {"poisoned_all_nan": bool(poisoned.isnan().all()), "next_call_equals_input": bool(torch.equal(fixed, want))}


def markdown(results: dict) -> str:
    lines = [f"# Save A/B: {results['device']}, {results['date']}, commit {results['commit']}", "",
             "Frozen backward, µs (median of interleaved rounds' medians): kernel time from the saved input and "
             "from the saved output; through `torch.autograd.grad` with `save=\"input\"` and the default; JAX "
             "frozen forward + backward (jitted apart) for normkit (`save=\"auto\"`) and XLA.", "",
             "| op | dtype | M x N | kernel in | kernel out | out/in | fwd +rec/fwd | e2e in | e2e auto | auto/in | "
             "jax auto | jax xla | auto/xla |", "|" + "---|" * 13]
    for c in results["cells"]:
        kb, kf, e = c["torch"]["kernel_bwd"], c["torch"]["kernel_fwd"], c["torch"]["e2e_bwd"]
        j = c.get("jax", {})
        lines.append(f"| {c['op']} | {c['dtype']} | {c['M']}x{c['N']} | {kb['input']:.1f} | {kb['output']:.1f} | "
                     f"{kb['ratio']:.3f} | {kf['ratio']:.3f} | {e['input']:.1f} | {e['auto']:.1f} | {e['ratio']:.3f} | "
                     f"{j.get('auto', float('nan')):.1f} | {j.get('xla', float('nan')):.1f} | "
                     f"{j.get('ratio_auto_xla', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="rms_norm,layer_norm,fused_add_rms_norm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "save_ab_h200.json"))
    p.add_argument("--no-jax", action="store_true")
    p.add_argument("--host-ab", action="store_true", help="also the launch paths' host time")
    p.add_argument("--sweep", action="store_true", help="only the output-saving backward's tiles, kernel time")
    p.add_argument("--only", default="", help="only these cells: op:dtype:MxN[,...] (e.g. rms_norm:bf16:8192x8192)")
    p.add_argument("--tiles", default="", help="--sweep: only these tiles (e.g. w1,w2_p1s3,m*: * ends a prefix)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    only = tuple(c for c in args.only.split(",") if c)
    tiles = tuple(t for t in args.tiles.split(",") if t)
    import datetime

    import torch

    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    timer = Timer(dry=dry) if dry else Timer(warmup_ms=5, rep_ms=20)
    env = versions()
    name = "CPU (dry run: Triton's interpreter)" if dry else torch.cuda.get_device_name(device)
    results = {"schema": "normkit-save-ab/1", "device": name, "commit": env.get("git"),
               "date": datetime.date.today().isoformat(), "versions": env, "cells": []}
    if not dry:
        results["copy"] = timer.copy_bandwidth()
    if args.sweep:
        for op, dtype, (M, N) in _cells(args.ops.split(","), dry, only):
            row = sweep_cell(op, dtype, M, N, timer, tiles)
            results["cells"].append({"op": op, "dtype": dtype, "M": M, "N": N, "sweep": row})
            best = min(((v, k) for k, v in row.items() if k != "input"), default=(0, "planned"))
            print(f"{op} {dtype} {M}x{N}: input {row['input']:.1f} | " + " ".join(
                f"{k} {v:.1f} ({v / row['input']:.3f})" for k, v in row.items() if k != "input")
                  + f" | best {best[1]}", flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))  # each cell, as it ends
        return 0
    for op, dtype, (M, N) in _cells(args.ops.split(","), dry, only):
        t0 = time.perf_counter()
        cell = {"op": op, "dtype": dtype, "M": M, "N": N, "torch": torch_cell(op, dtype, M, N, timer, args.rounds,
                                                                            device)}
        if not args.no_jax:
            cell["jax"] = jax_cell(op, dtype, M, N, timer, args.rounds)
        if not dry:
            torch.cuda.empty_cache()
        results["cells"].append(cell)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))  # each cell, as it ends
        kb = cell["torch"]["kernel_bwd"]
        print(f"[{time.perf_counter() - t0:5.1f}s] {op} {dtype} {M}x{N}: bwd kernel {kb['input']:.1f} -> "
              f"{kb['output']:.1f} us ({kb['ratio']:.3f}), e2e {cell['torch']['e2e_bwd']['ratio']:.3f}"
              + (f", jax auto/xla {cell['jax']['ratio_auto_xla']:.3f}" if "jax" in cell else ""), flush=True)
    results["trip"] = trip_check(device)
    if args.host_ab:
        results["host_ab"] = host_ab(timer, 2 if dry else 40, 5 if dry else 100, device)
        print("host A/B:", results["host_ab"], flush=True)
    print("trip:", results["trip"], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
