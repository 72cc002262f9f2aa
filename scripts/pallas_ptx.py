"""The PTX of normkit's Pallas kernels, made on any machine: no GPU needed.

A JAX op with ``implementation="pallas"`` is lowered for CUDA (``lowering_platforms=("cuda",)``);
each Pallas kernel in it is a custom call carrying the Triton IR that Pallas's Triton lowering made.
That IR is printed as text (jaxlib's MLIR, with its Triton dialect), then compiled by Triton for an
H100/H200 (sm_90) to PTX, as XLA would compile it on the GPU. For each kernel the script prints its
grid, warps and the global loads and stores of the PTX (their widths say whether the accesses are
vectorized), and with ``--out`` writes the ``.ttir`` and ``.ptx`` files.

    python scripts/pallas_ptx.py --op rms_norm --mode fwd --shape 8192x8192 [--out /tmp/ptx]

This reads private JAX modules (``jax._src``); a JAX version that moved them fails with a message
naming what is missing.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_frontend import _pallas  # noqa: E402
from normkit.ops import OPS  # noqa: E402
from scripts.tune_pallas import MODES, launcher  # noqa: E402  (the frontend's call for each mode)

TRITON_CALL = "__gpu$xla.gpu.triton"


def _target_gpu():
    """Lower for an H200 whatever the machine has. JAX 0.11's Pallas-Triton lowering reads the GPU
    from the abstract mesh's device when no GPU is present (it raises otherwise); a 1-device
    abstract mesh names it. A JAX without abstract devices lowers for sm_90 by default."""
    import contextlib

    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("_",), abstract_device=device))


def lowered_kernels(op_name: str, mode: str, M: int, N: int, dtype: str, num_sms: int) -> list[dict]:
    """``[{"name", "grid", "num_warps", "num_stages", "ir"}]``: each Pallas kernel of the op, lowered for CUDA."""
    op = OPS[op_name]
    _pallas.NUM_SMS = num_sms  # the persistent grids and partial buffers are sized as on the GPU
    x = jax.ShapeDtypeStruct((M, N), jnp.dtype(dtype))
    p = jax.ShapeDtypeStruct((N,), jnp.dtype(dtype))
    bias = p if "bias" in op.params else None
    if mode == "fwd":
        args = (x, x if op.has_residual else None, p, bias)
    else:
        stats = jax.ShapeDtypeStruct((M,), jnp.float32)
        args = (x, p, x, x if op.has_residual else None, None if op.is_rms else stats, stats)
    f = launcher(op, mode)
    with _target_gpu():
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    kernels = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and \
                            str(inner.attributes["call_target_name"]).strip('"') == TRITON_CALL:
                        kernels.append(_describe(inner))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    if not kernels:
        raise RuntimeError(f"no Pallas-Triton kernel in the lowering of {op_name} {mode}")
    return kernels


def _describe(call) -> dict:
    from jax._src.lib.mlir import ir

    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    out = {"ir": ir.StringAttr(config["ir"]).value_bytes, "name": str(config["name"]).strip('"')
           if "name" in config else "kernel"}
    for key in ("grid_x", "num_warps", "num_stages"):
        out[key] = ir.IntegerAttr(config[key]).value if key in config else None
    return out


def ttir_text(ir_bytes: bytes) -> str:
    """The Triton IR (MLIR bytecode made by jaxlib) as text."""
    try:
        from jax._src.lib import triton as jaxlib_triton
        from jax._src.lib.mlir import ir
    except ImportError as e:  # pragma: no cover (a JAX that moved them)
        raise RuntimeError(f"normkit: this JAX has no jax._src.lib.triton / mlir ({e})") from e
    ctx = ir.Context()
    jaxlib_triton.dialect.register_dialect(ctx)
    with ctx:
        return str(ir.Module.parse(ir_bytes))


def ptx_of(ttir: str, num_warps: int, num_stages: int | None, arch: int = 90) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttir"
        path.write_text(ttir)
        options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
        return triton.compile(str(path), target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers per thread and spill bytes of the PTX as ptxas (Triton's own copy) assembles it."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself compiles with

    ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else 0, "spill_loads": int(spills.group(2)) if spills else 0}


def summary(ptx: str) -> dict:
    """Global memory instructions by kind (e.g. ``ld.global.v4.b32``: 128-bit loads) and a few counts."""
    body = [line.strip() for line in ptx.splitlines()]
    insns = [line for line in body if line and not line.startswith(("//", ".", "$", "{", "}", "@%p", ")"))]
    mem = collections.Counter(m.group(0) for line in body for m in [re.search(r"\b(ld|st)\.global[.\w]*", line)] if m)
    return {"global": dict(sorted(mem.items())), "instructions": len(insns), "bar.sync": ptx.count("bar.sync"),
            "shfl": ptx.count("shfl.sync")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="rms_norm", choices=sorted(OPS))
    p.add_argument("--mode", default="fwd", choices=MODES)
    p.add_argument("--shape", default="8192x8192")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--num-sms", type=int, default=132, help="SM count the launch shapes are planned for (H200: 132)")
    p.add_argument("--out", type=Path, default=None, help="write <kernel>.ttir and <kernel>.ptx here")
    p.add_argument("--ptxas", action="store_true", help="also assemble with ptxas: registers per thread, spills")
    args = p.parse_args(argv)
    M, N = map(int, args.shape.split("x"))
    print(f"{args.op} {args.mode} {args.dtype} {M}x{N}, Pallas-Triton lowering, PTX for sm_90")
    for i, k in enumerate(lowered_kernels(args.op, args.mode, M, N, args.dtype, args.num_sms)):
        ttir = ttir_text(k["ir"])
        ptx = ptx_of(ttir, k["num_warps"] or 4, k["num_stages"])
        s = summary(ptx)
        print(f"  kernel {i}: {k['name']}, grid {k['grid_x']}, {k['num_warps']} warps: "
              f"{s['instructions']} instructions, bar.sync {s['bar.sync']}, shfl {s['shfl']}")
        for kind, count in s["global"].items():
            print(f"    {kind:24s} x {count}")
        if args.ptxas:
            u = ptxas_usage(ptx)
            print(f"    ptxas: {u['registers']} registers, spill stores {u['spill_stores']} B, "
                  f"spill loads {u['spill_loads']} B")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{i}_{k['name']}.ttir").write_text(ttir)
            (args.out / f"{i}_{k['name']}.ptx").write_text(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
