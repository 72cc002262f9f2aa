"""Registers and local memory of the backward kernels for an H200 (sm_90), compiled on any machine.

A plan's kernel (``normkit.launch.plan_backward``) is compiled by Triton for ``GPUTarget("cuda", 90,
32)`` and its cubin read with the ``cuobjdump`` Triton ships (``-res-usage``): registers per thread,
stack (spilled) bytes and shared memory. No GPU is needed, so the occupancy side of a tile's speed can
be read before any device time is spent: an SM holds 65,536 registers, so a program of ``warps`` warps
at ``regs`` registers per thread leaves room for ``65536 // (32 warps regs)`` programs per SM (fewer
where shared memory or the 2,048-thread limit bind first).

``python3 benchmarks/registers.py`` prints, for each op, dtype and row length of the README's cells,
the frozen backward from x and from y as planned; ``--sweep`` adds every tile ``save_ab.py --sweep``
tries (``benchmarks/save_ab.py``'s ``sweep_configs``); ``--ops``, ``--n`` pick. ``tests/test_codegen.py``
compiles through ``compile_sm90`` too.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

TYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
SMS = 132  # an H200's SMs, for the plans' persistent grids
REGS_PER_SM = 65536
THREADS_PER_SM = 2048


def compile_sm90(call, dtypes: dict, *, integer_hints: bool, float_type: str = "fp32", constants=()):
    """``(compiled kernel, parameter names)`` of ``call``'s kernel (a ``normkit.launch.KernelCall``)
    for sm_90. ``dtypes``: the element dtype of each present array input (absent ones are fp32
    placeholders, as both frontends pass them). Pointers are marked 16-byte aligned (both launchers
    do); integers divisible by 16 only with ``integer_hints`` (Triton's launcher, not jax-triton's),
    which also compiles an integer equal to 1 as a constant, as Triton's launcher specializes it.
    ``float_type``: how the launcher types a Python float argument (Triton's launcher and jax-triton:
    fp32; Inductor, for a user kernel: fp64). ``constants``: runtime scalars compiled as constants."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    pointer = {name: "*" + TYPES[dtypes[name]] for name in call.present_inputs}
    pointer.update({name: "*" + TYPES[dtype] for name, (_, dtype) in call.out_specs.items()})
    signature, attrs, constexprs = {}, {}, dict(call.constexprs)
    for i, name in enumerate(call.inputs + call.scalar_names + call.outputs):
        if name in call.scalar_names:
            value = call.scalars[call.scalar_names.index(name)]
            if name in constants or (integer_hints and value == 1 and isinstance(value, int)):
                signature[name], constexprs[name] = "constexpr", value
                continue
            signature[name] = float_type if isinstance(value, float) else "i32"
            if integer_hints and isinstance(value, int) and value % 16 == 0 and value != 0:
                attrs[(i,)] = CUDABackend.parse_attr("D")
        else:
            signature[name] = pointer.get(name, "*fp32")
            attrs[(i,)] = CUDABackend.parse_attr("D")
    signature.update({name: "constexpr" for name in call.constexprs})
    src = ASTSource(call.kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": call.num_warps, "num_stages": call.num_stages, "enable_fp_fusion": call.fp_fusion}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, [name for name, kind in signature.items() if kind != "constexpr"]


def resources(call, dtypes: dict) -> dict:
    """``{"regs", "stack", "shared", "programs_per_sm"}`` of ``call``'s kernel as Triton's own launcher
    compiles it for sm_90 (``cuobjdump -res-usage`` of its cubin); ``programs_per_sm``: how many of its
    programs the registers and threads of one SM hold at once."""
    from triton import knobs

    compiled, _ = compile_sm90(call, dtypes, integer_hints=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    usage = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED):(\d+)", text)}
    threads = 32 * call.num_warps
    return {"regs": usage["REG"], "stack": usage["STACK"], "shared": usage["SHARED"],
            "programs_per_sm": min(REGS_PER_SM // (threads * max(usage["REG"], 1)), THREADS_PER_SM // threads)}


def frozen_backward(op_name: str, dtype: str, M: int, N: int, from_output: bool, tile=None):
    """``(plan, input dtypes)`` of the frozen backward (dx alone) of contiguous rows, from x or from y;
    ``tile``: a ``normkit.launch._BWD_TILES`` value to plan it with instead of the table's."""
    from benchmarks.save_ab import backward_tile
    from normkit import launch
    from normkit.ops import ELEM_BYTES, OPS, Grads

    op = OPS[op_name]
    b = dtype if "bias" in op.params else None
    layout = (N, 1, N, 1, *((N, 1) if op.has_residual else (0, 1)), 1, 1)
    key = (op_name, from_output, ELEM_BYTES[dtype], launch.tile_config(1, N)[1])
    with contextlib.nullcontext() if tile is None else backward_tile(key, tile):
        call, _ = launch.plan_backward(op, M, N, dtype, dtype, b, op.has_residual, op.options(eps=op.default_eps),
                                       Grads(True, False, False), layout, SMS, from_output=from_output,
                                       has_bias=b is not None)
    dtypes = {**dict.fromkeys(("X", "DY", "DRES", "W", "B"), dtype), "MEAN": "float32", "RSTD": "float32",
              "REC": "float32"}
    return call, dtypes


def rows(ops, dtypes, lengths, sweep: bool) -> list[dict]:
    """One row per kernel: op, dtype, N, which backward and tile, warps, rows per tile, resources."""
    from benchmarks.save_ab import sweep_configs

    out = []
    for op_name in ops:
        for dtype in dtypes:
            for N in lengths:
                M = 8 * SMS * 16  # enough rows for every persistent grid to be full
                variants = [("from x", False, None), ("from y", True, None)]
                if sweep:
                    variants += [(f"from y {name}", True, tile) for name, tile in sweep_configs(N).items()]
                for what, from_output, tile in variants:
                    call, types = frozen_backward(op_name, dtype, M, N, from_output, tile)
                    c = call.constexprs
                    out.append({"op": op_name, "dtype": TYPES[dtype], "N": N, "backward": what,
                                "warps": call.num_warps, "BLOCK_M": c["BLOCK_M"], "CHUNK_N": c["CHUNK_N"],
                                "persistent": c["PERSISTENT"], "per_tile": c["PARAMS_PER_TILE"],
                                **resources(call, types)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="rms_norm,layer_norm,fused_add_rms_norm")
    p.add_argument("--dtypes", default="bf16,fp32", help=f"comma list of {', '.join(TYPES.values())} (or the full names)")
    p.add_argument("--n", default="1024,2048,4096,8192", help="row lengths")
    p.add_argument("--sweep", action="store_true", help="also every tile save_ab.py --sweep tries, from y")
    args = p.parse_args(argv)
    from benchmarks.report import markdown_table

    full = {short: name for name, short in TYPES.items()}
    dtypes = [full.get(d, d) for d in args.dtypes.split(",")]
    if unknown := [d for d in dtypes if d not in TYPES]:
        p.error(f"--dtypes: unknown {', '.join(unknown)}; expected {', '.join(TYPES.values())}")
    table = rows(args.ops.split(","), dtypes, [int(n) for n in args.n.split(",")], args.sweep)
    print(markdown_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
