"""The shared Triton kernels' code for an H200 (sm_90), compiled on any machine: no GPU needed.

The two GPU launchers specialize the kernel arguments differently. Triton's own launcher (the Torch
frontend) marks every pointer and every integer that is divisible by 16; jax-triton 0.3.1 marks the
pointers only, so a row stride passed at run time tells the compiler nothing about alignment. The
plans for contiguous rows must therefore address them with the compile-time N: then every row access
of x, residual, dy, y, s and dx compiles to 128-bit loads and stores under either launcher. A plan
that fell back to the run-time strides (as it did when an absent residual's placeholder stride
counted) compiles, under jax-triton's specialization, to scalar 16-bit loads: on the H200 that made
the RMSNorm forward 91 µs instead of 71 µs at 8192×8192 bf16.

A third launcher, Inductor (a compiled model's ``torch.library.triton_op``), types a Python float
argument as fp64: the kernels pin eps and offset to fp32, so the row math stays fp32 there too.

The Pallas kernels (``jax_frontend._pallas``'s forward and backward passes) are lowered for CUDA here too:
Pallas's Triton lowering makes Triton IR, which Triton compiles to the same PTX as XLA would on the GPU.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import re
import tempfile
from pathlib import Path

import pytest

from normkit.launch import plan_backward, plan_forward
from normkit.ops import OPS, Grads

import triton  # noqa: E402

M, N, SMS = 8192, 4096, 132


def ptx(call, dtypes: dict, *, integer_hints: bool, float_type: str = "fp32", constants=()) -> str:
    """The PTX of ``call``'s kernel for sm_90 (``benchmarks.registers.compile_sm90``: how each launcher
    specializes the arguments), its parameters named ``<kernel>_param_<name>``."""
    from benchmarks.registers import compile_sm90

    compiled, params = compile_sm90(call, dtypes, integer_hints=integer_hints, float_type=float_type,
                                    constants=constants)  # then Triton's scratch pointers
    return re.sub(rf"\b{call.name}_param_(\d+)\b",
                  lambda m: f"{call.name}_param_{params[int(m[1])] if int(m[1]) < len(params) else 'scratch'}",
                  compiled.asm["ptx"])


def instructions(code: str) -> list:
    """A PTX's lines without its debug information (source lines, the debug sections) and comments."""
    lines = [line.split("//")[0].rstrip() for line in code.split(".section\t.debug")[0].splitlines()]
    return [line for line in lines if line.strip() and not line.strip().startswith((".loc", ".file", "$L__tmp"))]


def global_accesses(code: str) -> collections.Counter:
    """Global memory instructions of a PTX by kind, cache qualifiers included: ``ld.global.v4.b32`` and
    ``ld.global.L1::evict_last.v4.b32`` are 128-bit loads; ``cp.async.cg.shared.global`` a pipelined
    load's copy of 16 bytes into shared memory."""
    return collections.Counter(m.group(0) for line in code.splitlines()
                               if (m := re.search(r"\b((ld|st)\.global|cp\.async\.\w+\.shared\.global)[.:\w]*",
                                                  line)))


def assert_rows_128_bits_wide(accesses: collections.Counter, what: str) -> None:
    narrow = {k: v for k, v in accesses.items() if ".v" not in k and k.endswith(".b16")}
    assert not narrow, f"{what}: 16-bit row accesses {dict(accesses)}"
    wide = {kind: sum(v for k, v in accesses.items() if k.startswith(kind) and k.endswith(".v4.b32"))
            for kind in ("ld.global", "st.global")}
    assert wide["ld.global"] > 0 and wide["st.global"] > 0, (what, dict(accesses))


def fwd_call(op_name: str):
    """The forward plan of bf16 rows and parameters, and its inputs' dtypes."""
    op = OPS[op_name]
    b = "bfloat16" if "bias" in op.params else None
    layout = (N, 1, *((N, 1) if op.has_residual else (0, 1)), 1, 1)  # as normkit.driver reads an absent array
    call = plan_forward(op, M, N, "bfloat16", "bfloat16", b, op.options(eps=op.default_eps), True, layout, SMS)
    return call, dict.fromkeys(("X", "R", "W", "B"), "bfloat16")


def bwd_call(op_name: str, trained: bool):
    op = OPS[op_name]
    b = "bfloat16" if "bias" in op.params else None
    grads = Grads(dx=True, dw=trained, db=trained and b is not None)
    layout = (N, 1, N, 1, *((N, 1) if op.has_residual else (0, 1)), 1, 1)
    call, _ = plan_backward(op, M, N, "bfloat16", "bfloat16", b, op.has_residual, op.options(eps=op.default_eps),
                            grads, layout, SMS)
    return call, {**dict.fromkeys(("X", "DY", "DRES", "W"), "bfloat16"), "MEAN": "float32", "RSTD": "float32"}


CALLS = [(f"{op} fwd", op, None) for op in sorted(OPS)] + \
        [(f"{op} bwd {'full' if t else 'frozen'}", op, t) for op in sorted(OPS) for t in (True, False)]


@pytest.mark.parametrize("what,op,trained", CALLS, ids=[c[0] for c in CALLS])
def test_contiguous_rows_are_accessed_128_bits_wide_under_either_launcher(what, op, trained):
    call, dtypes = fwd_call(op) if trained is None else bwd_call(op, trained)
    assert call.constexprs["ROWS_CONTIGUOUS"] is True, f"{what}: contiguous rows planned on the run-time strides"
    for hints in (False, True):
        assert_rows_128_bits_wide(global_accesses(ptx(call, dtypes, integer_hints=hints)), f"{what}, integer hints {hints}")


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm"])
def test_rows_read_in_two_passes_are_accessed_128_bits_wide_without_fp64(op):
    """The forward's two-pass variant (``CHUNK_N``: the sum of squares over chunks, then the rows again
    to normalize) keeps every row access 128 bits wide under either launcher, and its math fp32
    under Inductor's fp64 typing of float arguments."""
    import dataclasses

    call, dtypes = fwd_call(op)
    call = dataclasses.replace(call, constexprs=dict(call.constexprs, CHUNK_N=N // 2), cache={})
    for hints in (False, True):
        assert_rows_128_bits_wide(global_accesses(ptx(call, dtypes, integer_hints=hints)),
                                  f"{op} two-pass, integer hints {hints}")
    inductor = ptx(call, dtypes, integer_hints=True, float_type="fp64")
    assert not _f64_instructions(inductor), dict(_f64_instructions(inductor))


@pytest.mark.parametrize("op,chunk", [(op, c) for op in sorted(OPS) for c in (0, N // 2) if OPS[op].is_rms or not c],
                         ids=lambda v: v if isinstance(v, str) else "two passes" if v else "one pass")
def test_the_copy_of_y_adds_only_its_own_128_bit_stores(op, chunk):
    """HAS_Y2 (the forward also stores y widened to fp32, Y2) adds stores and nothing else, one pass or
    two: the same loads, and Y2's stores 128 bits wide, twice as many as y's bf16 ones (four fp32 per
    store against eight bf16), with no fp64 under Inductor's typing. The plan is otherwise the plan
    without the copy: the same constexprs, tile and grid."""
    import dataclasses

    spec = OPS[op]
    b = "bfloat16" if "bias" in spec.params else None
    layout = (N, 1, *((N, 1) if spec.has_residual else (0, 1)), 1, 1)
    plain, dtypes = fwd_call(op)
    copying = plan_forward(spec, M, N, "bfloat16", "bfloat16", b, spec.options(eps=spec.default_eps), True, layout,
                           SMS, y2_dtype="float32")
    assert plain.constexprs["HAS_Y2"] is False and "Y2" not in plain.out_specs
    assert copying.constexprs == dict(plain.constexprs, HAS_Y2=True)
    assert (copying.grid, copying.num_warps) == (plain.grid, plain.num_warps)
    assert copying.out_specs["Y2"] == ((M, N), "float32")
    before, after = (global_accesses(ptx(dataclasses.replace(c, constexprs=dict(c.constexprs, CHUNK_N=chunk), cache={}),
                                         dtypes, integer_hints=False)) for c in (plain, copying))
    assert {k: v for k, v in after.items() if k.startswith("ld.")} == {k: v for k, v in before.items()
                                                                       if k.startswith("ld.")}, (before, after)
    y_stores = before["st.global.v4.b32"] // (2 if spec.has_residual else 1)  # the fused add also stores s
    assert y_stores > 0 and after - before == {"st.global.v4.b32": 2 * y_stores}, (before, after)
    inductor = ptx(copying, dtypes, integer_hints=True, float_type="fp64")
    assert not _f64_instructions(inductor), dict(_f64_instructions(inductor))


DY_ROWS3_SCALARS = ("dy_n1", "dy_n2", "stride_dy1", "stride_dy2")
BWD_CALLS = [c for c in CALLS if c[2] is not None]


@pytest.mark.parametrize("what,op,trained", BWD_CALLS, ids=[c[0] for c in BWD_CALLS])
def test_dy_read_by_one_row_stride_compiles_as_without_the_three_index_mode(what, op, trained):
    """DY_ROWS3 off (every backward but a three-index dy's): the plan passes ones for the mode's four
    scalars. Triton's launcher compiles them as constants, so the kernel has no parameter for them;
    jax-triton passes them, and the code never reads them: its instructions are those of the kernel
    compiled without them, their declarations aside."""
    call, dtypes = bwd_call(op, trained)
    assert call.constexprs["DY_ROWS3"] is False
    assert [call.scalars[call.scalar_names.index(name)] for name in DY_ROWS3_SCALARS] == [1, 1, 1, 1]
    declared = [f"{call.name}_param_{name}" for name in DY_ROWS3_SCALARS]
    assert not any(d in ptx(call, dtypes, integer_hints=True) for d in declared), what
    passed = instructions(ptx(call, dtypes, integer_hints=False))
    assert sum(d in line for line in passed for d in declared) == 4, what  # the declarations, nothing more
    without = instructions(ptx(call, dtypes, integer_hints=False, constants=DY_ROWS3_SCALARS))
    assert [line for line in passed if not any(d in line for d in declared)] == without, what


@pytest.mark.parametrize("op,trained", [("rms_norm", False), ("rms_norm", True), ("layer_norm", False)])
def test_dy_read_by_three_row_indices_is_accessed_128_bits_wide(op, trained):
    """A [B, S, H, D] view of a [B, H, S, D] bf16 dy (a QK-norm's output gradient from attention's
    backward, head_dim 128) read by three row indices (DY_ROWS3), under Triton's launcher (the Torch
    frontend's, which marks the strides divisible by 16): the same global accesses as a contiguous dy
    (each row 128 bits at a time: two 16-byte loads or pipelined copies per thread and row stream; the
    16-bit load is the weight's, one column per thread), with the other rows still addressed by the
    compile-time N."""
    B, S, H, D = 2, 64, 8, 128
    spec = OPS[op]
    b = "bfloat16" if "bias" in spec.params else None
    grads = Grads(dx=True, dw=trained, db=trained and b is not None)
    dtypes = {**dict.fromkeys(("X", "DY", "W", "B"), "bfloat16"), "MEAN": "float32", "RSTD": "float32"}

    def plan(dy_stride, dy_rows):
        return plan_backward(spec, B * S * H, D, "bfloat16", "bfloat16", b, False, spec.options(eps=spec.default_eps),
                             grads, (D, 1, dy_stride, 1, 0, 1, 1, 1), SMS, dy_rows=dy_rows)[0]

    contiguous, three = plan(D, None), plan(H * S * D, (S, H, D, S * D))
    assert three.constexprs == dict(contiguous.constexprs, DY_ROWS3=True) and three.constexprs["ROWS_CONTIGUOUS"]
    assert (three.grid, three.num_warps) == (contiguous.grid, contiguous.num_warps)
    accesses = global_accesses(ptx(three, dtypes, integer_hints=True))
    assert accesses == global_accesses(ptx(contiguous, dtypes, integer_hints=True)), op
    wide = "cp.async.cg.shared.global" if trained else "ld.global.v4.b32"  # dW's loop prefetches x and dy
    assert accesses[wide] == 2 * 2 * (3 if trained else 1), (op, accesses)


def test_an_absent_input_does_not_decide_the_row_addressing():
    """A present strided residual still sends the plan to the run-time strides; an absent one does not."""
    op = OPS["fused_add_rms_norm"]
    strided = plan_forward(op, M, N, "bfloat16", "bfloat16", None, op.options(eps=op.default_eps), True,
                           (N, 1, 2 * N, 1, 1, 1), SMS)
    assert strided.constexprs["ROWS_CONTIGUOUS"] is False
    assert fwd_call("rms_norm")[0].constexprs["ROWS_CONTIGUOUS"] is True
    assert bwd_call("layer_norm", True)[0].constexprs["ROWS_CONTIGUOUS"] is True


def _f64_instructions(code: str) -> collections.Counter:
    """fp64 instructions of a PTX other than reading a scalar parameter and rounding it to fp32."""
    found = collections.Counter()
    for line in code.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        if ".f64" in op and not op.startswith(("ld.param", "cvt.rn.f32.f64")):
            found[op] += 1
    return found


@pytest.mark.parametrize("what,op,trained", CALLS, ids=[c[0] for c in CALLS])
def test_an_fp64_scalar_from_inductor_does_not_promote_the_math(what, op, trained):
    """Inductor passes a Python float to a user Triton kernel as fp64 (``torch._inductor.codegen.
    triton_utils.signature_of``), where Triton's launcher and jax-triton pass fp32. Without the
    kernels' fp32 pin of eps and offset, the compiled model's norms ran their row math in fp64: on
    the H200, 65 against 34 µs per forward and 88 against 50 µs per frozen backward (8192×4096 bf16,
    a compiled Llama LoRA step). The pinned kernel does the same fp32 math under either typing."""
    call, dtypes = fwd_call(op) if trained is None else bwd_call(op, trained)
    inductor = ptx(call, dtypes, integer_hints=True, float_type="fp64")
    assert not _f64_instructions(inductor), f"{what}: fp64 math under Inductor's typing {dict(_f64_instructions(inductor))}"
    eager = ptx(call, dtypes, integer_hints=True)
    assert global_accesses(inductor) == global_accesses(eager), what


ROPE_CASES = [("fwd", False, False), ("bwd from x", False, False), ("bwd from y", True, False),
              ("bwd with dW", False, True)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("what,from_output,dw", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rms_norm_rope_kernels_compile_for_sm90(what, from_output, dw, interleaved):
    """The fused QK-norm + RoPE kernels compile for an H200 (sm_90) at head_dim 128 on [B, S, H, D]
    rows read as [B, H, S, D] with broadcast tables, with every access 128 bits wide under either
    launcher's argument typing: each row is read once as contiguous blocks (rotate_half's two halves;
    interleaved pairs split in registers), and the plan's STRIDES_ALIGNED marks the row starts
    16-byte aligned, which jax-triton's typing of the run-time strides does not tell the compiler.
    Their math stays fp32 under Inductor's fp64 typing of float arguments."""
    from normkit.launch import plan_rope_backward, plan_rope_forward

    D, rows = 128, (2, 8, 16)  # (B, H, S) of a [B, S, H, D] buffer
    x_strides = (16 * 8 * D, D, 8 * D)
    table = (0, 0, D)
    opts = OPS["rms_norm"].options(eps=1e-6)
    dtypes = {"X": "bfloat16", "W": "bfloat16", "COS": "bfloat16", "SIN": "bfloat16", "DY": "bfloat16",
              "RSTD": "float32", "REC": "float32"}
    if what == "fwd":
        call = plan_rope_forward(D, rows, "bfloat16", "bfloat16", opts, interleaved, True, True,
                                 (x_strides, table, table, x_strides), 1, (2, 16, 8, D),
                                 table_dtypes=("bfloat16", "bfloat16"))
    else:
        call, _ = plan_rope_backward(D, rows, "bfloat16", "bfloat16", opts, interleaved, Grads(True, dw, False),
                                     from_output, (x_strides, table, table, x_strides, x_strides), 1, SMS,
                                     (2, 16, 8, D), table_dtypes=("bfloat16", "bfloat16"))
    assert call.constexprs["STRIDES_ALIGNED"] is True, f"rope {what}: aligned strides planned as unaligned"
    for hints in (False, True):
        assert_rows_128_bits_wide(global_accesses(ptx(call, dtypes, integer_hints=hints)),
                                  f"rope {what}, integer hints {hints}")
    inductor = ptx(call, dtypes, integer_hints=True, float_type="fp64")
    assert not _f64_instructions(inductor), dict(_f64_instructions(inductor))


# ---------------------------------------------------------------------------------------------
# The Pallas kernels, lowered for CUDA through the public API.

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call that carries a Pallas-Triton kernel's IR


def _h200():
    """Lower for an H200 whatever this machine has: JAX's Pallas-Triton lowering reads the GPU from the
    abstract mesh's device when no GPU is present; a JAX without abstract devices lowers for sm_90."""
    sharding = __import__("jax").sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("_",), abstract_device=device))


def pallas_ptx(fn, *args) -> dict:
    """``{kernel name: PTX}`` of every Pallas kernel in ``jax.jit(fn)(*args)`` lowered for CUDA: jaxlib's
    private MLIR bindings print the kernel's Triton IR, which Triton compiles for sm_90."""
    import jax
    from jax._src.lib import triton as jaxlib_triton
    from jax._src.lib.mlir import ir
    from triton.backends.compiler import GPUTarget

    with _h200():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    found = {}

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if (inner.operation.name == "stablehlo.custom_call"
                            and str(inner.attributes["call_target_name"]).strip('"') == TRITON_CALL):
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        context = ir.Context()
                        jaxlib_triton.dialect.register_dialect(context)
                        with context:
                            ttir = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
                        found[str(config["name"]).strip('"')] = (ttir, ir.IntegerAttr(config["num_warps"]).value)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ttir, warps) in found.items():
            path = Path(tmp) / f"{name}.ttir"
            path.write_text(ttir)
            out[name] = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": warps}).asm["ptx"]
    return out


@functools.cache
def pallas_training_step(op_name: str) -> dict:
    """The PTX of a training step's Pallas kernels at 64 x 256 bf16, weight and bias frozen: the
    training forward and the frozen backward (the vjp with respect to the row inputs only)."""
    import jax
    import jax.numpy as jnp

    from jax_frontend import _pallas
    from normkit.ops import Grads

    op = OPS[op_name]
    opts = op.options(eps=op.default_eps)
    rows, col = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.bfloat16)
    args = [rows if name in op.row_inputs else col for name in op.inputs]

    def step(*args):
        # The implementation's own passes (what each device runs), not the frontend's partitioned
        # primitive: JAX 0.11 lowers no primitive that needs devices under an abstract mesh.
        a = dict(zip(op.inputs, args))
        fwd = _pallas.forward(op, a["x"], a.get("residual"), a.get("weight"), a.get("bias"), opts=opts,
                              store_stats=True)
        saved = fwd["S"] if op.has_residual else a["x"]
        dres = fwd["S"] if op.has_residual else None  # residual_out's gradient, as in a training step
        return _pallas.backward(op, saved, a.get("weight"), fwd["Y"], dres, fwd.get("MEAN"), fwd["RSTD"], opts=opts,
                                grads=Grads(dx=True, dw=False), b_dtype=None)

    return pallas_ptx(step, *args)


@pytest.mark.parametrize("op", sorted(OPS))
def test_pallas_rows_are_accessed_128_bits_wide(op):
    kernels = pallas_training_step(op)
    assert sorted(kernels) == [f"normkit_{op}_bwd", f"normkit_{op}_fwd"], sorted(kernels)
    for name, code in kernels.items():
        assert_rows_128_bits_wide(global_accesses(code), name)


def test_pallas_fused_backward_reads_one_more_row_stream():
    """The fused add's frozen backward reads s, dy and d(residual_out), RMSNorm's x and dy: 3/2 of the
    128-bit loads, at the same shape and launch."""
    loads = {op: global_accesses(pallas_training_step(op)[f"normkit_{op}_bwd"])["ld.global.v4.b32"]
             for op in ("rms_norm", "fused_add_rms_norm")}
    assert 2 * loads["fused_add_rms_norm"] == 3 * loads["rms_norm"], loads


@functools.cache
def pallas_rope_step(interleaved: bool, weight: str) -> dict:
    """The PTX of ``rms_norm_rope``'s Pallas kernels in a training step through the JAX frontend, bf16
    at head_dim 128: x [B, S, H, D] with [B, S, 1, D] tables (their rows gathered by each x row's table
    row), the vjp with respect to x and the weight. ``weight``: "trained" (dW: the partials and their
    sum), "frozen" (the output kept: the forward writes REC, the backward reads the output) or
    "frozen, x kept" (``save="input"``)."""
    import jax
    import jax.numpy as jnp

    import jax_frontend as jf

    B, S, H, D = 2, 16, 8, 128
    x = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D,), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((B, S, 1, D), jnp.bfloat16)

    def step(x, w, cos, sin, dy):
        def f(x, w):
            w = w if weight == "trained" else jf.freeze(w, False)
            return jf.rms_norm_rope(x, w, cos, sin, interleaved=interleaved,
                                    save="input" if weight == "frozen, x kept" else "auto", implementation="pallas")

        _, vjp = jax.vjp(f, x, w)
        return vjp(dy)

    return pallas_ptx(step, x, w, table, table, x)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_pallas_rms_norm_rope_compiles_with_rows_128_bits_wide(interleaved):
    """The Pallas rms_norm_rope kernels lower for CUDA and compile for an H200 (sm_90), trained, frozen
    (from the output) and frozen with x kept; every row access 128 bits wide, the tables' gathered rows
    and the weight's tiles included (interleaved: whole rows split into pairs in registers). The one
    exception is the forward's recovery of the weight: program 0 reads the D-vector once more."""
    steps = {weight: pallas_rope_step(interleaved, weight) for weight in ("trained", "frozen", "frozen, x kept")}
    assert sorted(steps["trained"]) == ["normkit_partial_sum", "normkit_rms_norm_rope_bwd",
                                        "normkit_rms_norm_rope_fwd"], sorted(steps["trained"])
    for weight, kernels in steps.items():
        if weight != "trained":
            assert sorted(kernels) == ["normkit_rms_norm_rope_bwd", "normkit_rms_norm_rope_fwd"], (weight, kernels)
        assert_rows_128_bits_wide(global_accesses(kernels["normkit_rms_norm_rope_bwd"]), f"{weight} backward")
        if weight != "frozen":
            assert_rows_128_bits_wide(global_accesses(kernels["normkit_rms_norm_rope_fwd"]), f"{weight} forward")
    plain, with_rec = (global_accesses(steps[w]["normkit_rms_norm_rope_fwd"]) for w in ("trained", "frozen"))
    assert with_rec["ld.global.v4.b32"] == plain["ld.global.v4.b32"], (plain, with_rec)


@pytest.mark.slow  # two sm_90 compilations per entry
@pytest.mark.parametrize("entry", sorted(__import__("normkit.launch", fromlist=["_BWD_TILES"])._BWD_TILES),
                         ids=lambda k: f"{k[0]}-{'output' if k[1] else 'input'}-{k[2]}B-{k[3]}")
def test_each_planned_backward_tile_fits_an_sm_without_spilling(entry):
    """Each measured backward tile (``normkit/tiles.json``'s ``backward_dx``) and the input-saving plan
    at the same row length compile for sm_90 without spilling registers, and one SM holds at least
    one of their programs (``benchmarks/registers.py``, which reports the counts)."""
    from benchmarks.registers import frozen_backward, resources

    op, from_output, elem_bytes, block_n = entry
    dtype = {2: "bfloat16", 4: "float32"}[elem_bytes]
    for from_y in sorted({False, from_output}):
        call, dtypes = frozen_backward(op, dtype, 4096, block_n, from_y)
        got = resources(call, dtypes)
        assert got["stack"] == 0 and 0 < got["regs"] <= 255 and got["programs_per_sm"] >= 1, (entry, from_y, got)
