"""The Pallas (interpret mode on CPU) and XLA implementations against the float64 reference.

Both implement ``forward`` / ``backward`` over 2-D rows (``jax_frontend._pallas``, ``_xla``); the
test bodies are written once and get the implementation from the ``impl`` fixture.

Coverage: every op x dtype x casting mode x offset x weight/bias presence x every subset of
gradients (and, for the fused op, with and without a residual_out cotangent), each case at one of
the small shapes, rotating so that every shape is met. Compile time dominates on CPU, so each
(op, dtype) runs all its cases in one jitted program (one XLA compile), compiled at low
optimization; a failure names every failing case.

Poisoned outputs are not possible in Pallas; instead every output must be finite wherever the
reference is, and the returned keys must be exactly the op's buffers.

On a GPU machine the same tests run the compiled Pallas kernels (the platform picks the lowering).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_frontend import _pallas, _xla
from normkit import launch
from normkit.ops import OPS, Casting, Grads, Options
from normkit.testing import TOLERANCES, assert_close

IMPLS = {"pallas": _pallas, "xla": _xla}
DTYPES = ("float32", "bfloat16", "float16")
SHAPES = ((5, 3), (9, 127), (4, 1000), (1, 64), (33, 40))
# On CPU, at these shapes, compiling is all the cost: compile fast, not well.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# JAX 0.11 warns once per lowering that Pallas's Triton backend is deprecated (see jax_frontend._pallas).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _jit(fn):
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS if jax.default_backend() == "cpu" else None)


# ---------------------------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass(frozen=True)
class Config:
    casting: Casting
    offset: float
    has_w: bool
    has_b: bool


def configs(op) -> list[Config]:
    """Every casting mode x offset x parameter presence the op takes (offset acts on the weight)."""
    if op.has_offset:
        return [Config(c, off, w, False) for c in Casting for off, w in ((0.0, True), (0.0, False), (1.0, True))]
    return [Config(Casting.FP32, 0.0, w, b) for w, b in itertools.product((True, False), repeat=2)]


def grads_subsets(has_w: bool, has_b: bool) -> list[Grads]:
    """Every non-empty choice of gradients among the inputs present."""
    out = []
    for dx, dw, db in itertools.product((False, True), repeat=3):
        if (dx or dw or db) and (has_w or not dw) and (has_b or not db):
            out.append(Grads(dx, dw, db))
    return out


def _rounded(a, dtype: str) -> np.ndarray:
    """a as the float64 values it takes once stored in ``dtype``."""
    return np.asarray(a, np.float32).astype(jnp.dtype(dtype)).astype(np.float64)


def make_inputs(op, cfg: Config, shape, dtype: str, rng, w_dtype: str | None = None) -> dict:
    M, N = shape
    wd = w_dtype or dtype
    inp = {"x": _rounded(rng.standard_normal(shape) * 1.5 + 0.3, dtype)}
    if op.has_residual:
        inp["residual"] = _rounded(rng.standard_normal(shape), dtype)
    if cfg.has_w:
        inp["weight"] = _rounded(rng.uniform(0.5, 1.5, N) * rng.choice([-1.0, 1.0], N), wd)
    if cfg.has_b:
        inp["bias"] = _rounded(rng.standard_normal(N) * 0.5, wd)
    inp["dy"] = _rounded(rng.standard_normal(shape), dtype)
    if op.has_residual:
        inp["ds"] = _rounded(rng.standard_normal(shape), dtype)
    return inp


def _arrays(inp: dict, dtype: str, w_dtype: str | None = None) -> dict:
    wd = w_dtype or dtype
    return {k: jnp.asarray(v, wd if k in ("weight", "bias") else dtype) for k, v in inp.items()}


@dataclasses.dataclass(frozen=True)
class Case:
    """One forward and the backwards that follow it (every gradient subset)."""

    op_name: str
    cfg: Config
    shape: tuple
    dtype: str
    w_dtype: str | None = None

    @property
    def op(self):
        return OPS[self.op_name]

    @property
    def opts(self) -> Options:
        return Options(self.op.default_eps, self.cfg.offset, self.cfg.casting)

    @property
    def backwards(self) -> list[tuple[Grads, bool]]:
        """(grads, with a residual_out cotangent): every subset; the fused op also without ds."""
        out = [(g, self.op.has_residual) for g in grads_subsets(self.cfg.has_w, self.cfg.has_b)]
        if self.op.has_residual:
            out.append((Grads(True, self.cfg.has_w), False))
        return out

    def __str__(self):
        c = self.cfg
        return (f"{self.op_name}-{self.shape[0]}x{self.shape[1]}-{self.dtype}-w={self.w_dtype or c.has_w}-b={c.has_b}"
                f"-{c.casting.name}-off={c.offset}")


def run_cases(impl, cases: list[Case], arrays: list[dict], stats_free: bool = False):
    """Every case's forward and backwards, all in one jitted program."""

    def program(arrays):
        results = []
        for case, a in zip(cases, arrays):
            op = case.op
            fwd = impl.forward(op, a["x"], a.get("residual"), a.get("weight"), a.get("bias"), opts=case.opts,
                               store_stats=True)
            res = {"fwd": fwd, "bwd": []}
            if stats_free:
                res["fwd_nostats"] = impl.forward(op, a["x"], a.get("residual"), a.get("weight"), a.get("bias"),
                                                  opts=case.opts, store_stats=False)
            saved = fwd["S"] if op.has_residual else a["x"]
            for grads, with_ds in case.backwards:
                res["bwd"].append(impl.backward(
                    op, saved, a.get("weight"), a["dy"], a["ds"] if with_ds else None, fwd.get("MEAN"), fwd["RSTD"],
                    opts=case.opts, grads=grads, b_dtype=case.w_dtype or case.dtype if case.cfg.has_b else None))
            results.append(res)
        return results

    return jax.device_get(_jit(program)(arrays))


def _finite_where_reference_is(actual, ref, what):
    actual, ref = np.asarray(actual, np.float64), np.asarray(ref, np.float64)
    bad = np.isfinite(ref) & ~np.isfinite(actual)
    assert not bad.any(), f"{what}: non-finite at {np.argwhere(bad)[:5].tolist()} where the reference is finite"


def _check(actual, ref, dtype, what, reduced_over=1):
    _finite_where_reference_is(actual, ref, what)
    assert_close(actual, ref, dtype, what, reduced_over=reduced_over)


def _check_buffers(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for name, (shape, dtype) in want.items():
        assert got[name].shape == tuple(shape) and got[name].dtype == jnp.dtype(dtype), (
            f"{what}: {name} is {got[name].dtype}{list(got[name].shape)}, expected {dtype}{list(shape)}")


def check_case(case: Case, inp: dict, res: dict) -> None:
    """Forward outputs, statistics and every backward against the float64 reference."""
    op, (M, N), dt = case.op, case.shape, case.dtype
    wd = case.w_dtype or dt
    wtol = wd if wd in TOLERANCES else dt  # float64 dW/dB come from fp32 partials of x.dtype products
    fwd = res["fwd"]
    _check_buffers(fwd, op.fwd_buffers(M, N, dt, True), f"{case} forward")
    params = {k: inp.get(k) for k in op.inputs}
    ref_out, _ = op.run_reference(params, case.opts, {"y": inp["dy"]})
    _check(fwd["Y"], ref_out["y"], dt, f"{case}: y")
    if op.has_residual:
        _check(fwd["S"], ref_out["residual_out"], dt, f"{case}: residual_out")
    # Statistics of the rows as normalized (the stored s for the fused op).
    xs = np.asarray(fwd["S"], np.float64) if op.has_residual else inp["x"]
    mu = 0.0 if op.is_rms else xs.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((xs - mu) ** 2).mean(axis=1) + case.opts.eps)
    _check(fwd["RSTD"], rstd, dt, f"{case}: rstd")
    if not op.is_rms:
        _check(fwd["MEAN"], xs.mean(axis=1), dt, f"{case}: mean")
    if "fwd_nostats" in res:
        _check_buffers(res["fwd_nostats"], op.fwd_buffers(M, N, dt, False), f"{case} forward without stats")
        for name, value in res["fwd_nostats"].items():
            assert np.array_equal(value, fwd[name], equal_nan=True), f"{case}: {name} depends on store_stats"

    for (grads, with_ds), got in zip(case.backwards, res["bwd"]):
        what = f"{case} {grads}{'' if with_ds or not op.has_residual else ' no-ds'}"
        _check_buffers(got, op.bwd_buffers(M, N, dt, grads, wd if case.cfg.has_w else None,
                                           wd if case.cfg.has_b else None), what)
        cot = {"y": inp["dy"], **({"residual_out": inp["ds"]} if with_ds else {})}
        _, ref_grads = op.run_reference(params, case.opts, cot)
        if grads.dx:
            _check(got["DX"], ref_grads["x"], dt, f"{what}: dx")
            if op.has_residual:
                _check(got["DX"], ref_grads["residual"], dt, f"{what}: dresidual")
        if grads.dw:
            _check(got["DW"], ref_grads["weight"], wtol, f"{what}: dweight", reduced_over=M)
        if grads.db:
            _check(got["DB"], ref_grads["bias"], wtol, f"{what}: dbias", reduced_over=M)


def _run_and_check(impl, cases: list[Case], stats_free: bool = False):
    inputs = []
    for case in cases:
        rng = np.random.default_rng(zlib.crc32(str(case).encode()))
        inputs.append(make_inputs(case.op, case.cfg, case.shape, case.dtype, rng, case.w_dtype))
    results = run_cases(impl, cases, [_arrays(i, c.dtype, c.w_dtype) for c, i in zip(cases, inputs)], stats_free)
    errors = []
    for case, inp, res in zip(cases, inputs, results):
        try:
            check_case(case, inp, res)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, f"{len(errors)} of {len(cases)} cases failed:\n" + "\n".join(errors)


# ---------------------------------------------------------------------------------------------
# Tests.


# The default run takes one dtype per op, each a different one (a 16-bit one where the casting modes
# differ); the other dtypes are in the slow tier (pytest -m slow). Every variant of both
# implementations, in every dtype, also runs through the JAX frontend in test_parity.py's default run.
QUICK_DTYPE = {"fused_add_rms_norm": "bfloat16", "rms_norm": "float16", "layer_norm": "float32"}


@pytest.mark.parametrize("op_name,dtype", [
    pytest.param(op_name, dtype, marks=() if dtype == QUICK_DTYPE[op_name] else pytest.mark.slow)
    for op_name in sorted(OPS) for dtype in DTYPES])
def test_parity(impl, op_name, dtype):
    """Every casting x offset x parameter set x gradient subset of one op and dtype."""
    op = OPS[op_name]
    shift = DTYPES.index(dtype) + sorted(OPS).index(op_name)
    cases = [Case(op_name, cfg, SHAPES[(i + shift) % len(SHAPES)], dtype) for i, cfg in enumerate(configs(op))]
    _run_and_check(impl, cases, stats_free=True)


def test_row_lengths(impl):
    """N = 1 and a power of two plus one (4097)."""
    _run_and_check(impl, [Case(name, Config(Casting.FP32, 0.0, True, name == "layer_norm"), shape, "float32")
                          for name in sorted(OPS) for shape in ((3, 1), (2, 4097))])


@pytest.mark.slow  # about 18 s in the Pallas interpreter
def test_long_row_lengths(impl, monkeypatch):
    """The longest row (65536); LayerNorm's long rows also through the persistent grids (the default
    for them: forward and dx-only backward, bf16 and fp32), several tiles per program."""
    monkeypatch.setattr(_pallas, "NUM_SMS", 4)
    monkeypatch.setattr(_pallas, "PERSISTENT_LAYER_NORM", True)
    cases = [Case("rms_norm", Config(Casting.ROUND_NORMALIZED, 1.0, True, False), (2, 65536), "bfloat16"),
             Case("layer_norm", Config(Casting.FP32, 0.0, True, True), (20, 5000), "bfloat16"),
             Case("layer_norm", Config(Casting.FP32, 0.0, True, True), (20, 3000), "float32")]  # fp32: persistent from 4096
    if impl is _pallas:
        for backward in (False, True):
            for dtype in ("bfloat16", "float32"):
                assert _pallas.blocks(OPS["layer_norm"], 20, 5000, dtype, backward=backward).tiles_per_program > 1
    _run_and_check(impl, cases)


def test_float64_params(impl):
    """Weights and biases may be float64 when x64 is on; their gradients keep that dtype."""
    with jax.enable_x64(True):
        cases = [Case("rms_norm", Config(Casting.ROUND_NORMALIZED, 1.0, True, False), (9, 127), "float32", "float64"),
                 Case("layer_norm", Config(Casting.FP32, 0.0, True, True), (33, 40), "bfloat16", "float64")]
        _run_and_check(impl, cases)


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_dw_deterministic(impl, op_name, monkeypatch):
    """dW/dB: two runs, and a fresh compile, are bitwise equal (fixed-order partials, no atomics)."""
    monkeypatch.setattr(_pallas, "NUM_SMS", 4)  # fewer programs than tiles on any machine
    op = OPS[op_name]
    M, N = 200, 96
    cfg = Config(Casting.FP32, 0.0, True, not op.is_rms)
    rng = np.random.default_rng(7)
    a = _arrays(make_inputs(op, cfg, (M, N), "bfloat16", rng), "bfloat16")
    grads = Grads(True, True, cfg.has_b)
    opts = Options(op.default_eps)

    traces = []

    def program(a):
        traces.append(1)
        fwd = impl.forward(op, a["x"], a.get("residual"), a["weight"], a.get("bias"), opts=opts, store_stats=True)
        return impl.backward(op, fwd["S"] if op.has_residual else a["x"], a["weight"], a["dy"], a.get("ds"),
                             fwd.get("MEAN"), fwd["RSTD"], opts=opts, grads=grads,
                             b_dtype="bfloat16" if cfg.has_b else None)

    jitted = _jit(program)
    first = jax.device_get(jitted(a))
    rerun = jax.device_get(jitted(a))  # the same executable again
    jax.clear_caches()  # else jax.jit reuses the trace and the executable of the same function
    again = jax.device_get(_jit(program)(a))  # a second trace and compile
    assert len(traces) == 2, f"traced {len(traces)} times, expected 2"
    for name in first:
        assert np.array_equal(first[name], rerun[name]) and np.array_equal(first[name], again[name]), name
    if impl is _pallas:  # the case does walk several tiles per program over several partial rows
        cfg_b = _pallas.blocks(op, M, N, "bfloat16", backward=True, reduces=True)
        assert cfg_b.num_programs > 1 and cfg_b.tiles_per_program > 1, cfg_b


def test_many_partials(monkeypatch):
    """More partial rows than one reduction step takes (G > BLOCK_G = 32), as on a GPU's SM count."""
    monkeypatch.setattr(_pallas, "NUM_SMS", 40)
    shape = (200, 1000)  # tiles of 4 x 1024: 50 tiles, 50 programs of one tile each
    cfg = _pallas.blocks(OPS["rms_norm"], *shape, "float32", backward=True, reduces=True)
    assert cfg.num_programs > launch.reduce_blocks(cfg.num_programs, shape[1])[0], cfg
    _run_and_check(_pallas, [Case("rms_norm", Config(Casting.FP32, 0.0, True, False), shape, "float32"),
                             Case("layer_norm", Config(Casting.FP32, 0.0, True, True), shape, "float32")])


def _walk(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its parameters (not into pallas_call kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _walk(sub)


def _branches(closed):
    """The platform branches of the one ``platform_dependent`` in the jaxpr: (cpu, default)."""
    conds = [e for e in _walk(closed.jaxpr) if e.primitive.name == "cond"]
    assert len(conds) == 1, [e.primitive.name for e in _walk(closed.jaxpr)]
    return [b.jaxpr for b in conds[0].params["branches"]]


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_frozen_params_cost_nothing(impl, op_name):
    """Without dW/dB no partial buffer, no reduction launch (Pallas), no column sum (XLA) is traced."""
    op = OPS[op_name]
    M, N = 64, 40
    x = jnp.ones((M, N), jnp.bfloat16)
    w = jnp.ones((N,), jnp.bfloat16)
    stats = jnp.ones((M,), jnp.float32)
    opts = Options(op.default_eps)
    has_b = not op.is_rms
    for grads in grads_subsets(True, has_b):
        jaxpr = jax.make_jaxpr(lambda x, w, dy, m, r, grads=grads: impl.backward(
            op, x, w, dy, dy if op.has_residual else None, None if op.is_rms else m, r, opts=opts, grads=grads,
            b_dtype="bfloat16" if has_b else None))(x, w, x, stats, stats)
        if impl is _pallas:
            G = _pallas.blocks(op, M, N, "bfloat16", backward=True, reduces=True).num_programs
            for branch in _branches(jaxpr):
                calls = [e for e in _walk(branch) if e.primitive.name == "pallas_call"]
                assert len(calls) == (2 if grads.reduces else 1), (grads, len(calls))
                out_shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in calls[0].outvars]
                parts = [s for s in out_shapes if s == ((G, N), jnp.float32)]
                assert len(parts) == grads.dw + grads.db, (grads, out_shapes)
                assert (((M, N), jnp.bfloat16) in out_shapes) == grads.dx, (grads, out_shapes)
        else:
            col_sums = [e for e in _walk(jaxpr.jaxpr) if e.primitive.name == "reduce_sum" and e.params["axes"] == (0,)]
            assert len(col_sums) == grads.dw + grads.db, (grads, col_sums)


def test_vmap_forward():
    """pallas_call batches by itself: a vmapped forward is one launch over a batch grid axis."""
    op = OPS["rms_norm"]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 9, 127)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(127), jnp.bfloat16)
    opts = Options(1e-6, 0.0, Casting.ROUND_NORMALIZED)
    fwd = functools.partial(_pallas.forward, op, opts=opts, store_stats=True)
    batched = _jit(jax.vmap(lambda x: fwd(x, None, w, None)))(x)
    for i in range(x.shape[0]):
        one = _jit(lambda x: fwd(x, None, w, None))(x[i])
        for name in one:
            assert np.array_equal(batched[name][i], one[name]), name


def test_block_invariants(monkeypatch):
    """The launch heuristic's invariants (not its tuned numbers), for every op, pass and row dtype,
    from one row to many, short rows to the longest, a few SMs or many:
    - a tile covers whole rows (BLOCK_N is the power of two >= N) and fits one program: at most 16384
      elements (or one row), at most 128 per thread (of 255 registers), BLOCK_M a power of two;
    - the programs cover every tile and each has work (tiles_per_program = ceil(tiles / programs));
    - dW/dB partials (one per program) are at most 2 per SM;
    - without dW/dB, one tile per program, except LayerNorm's persistent grids (at most 4 programs per SM)."""
    seen = set()
    for num_sms in (4, 132):
        monkeypatch.setattr(_pallas, "NUM_SMS", num_sms)
        for op, dtype, M, N, (backward, reduces) in itertools.product(
                OPS.values(), ("bfloat16", "float32"), (1, 5, 300, 8192, 32768), (1, 3, 96, 4096, 5000, 8192, 65536),
                ((False, False), (True, False), (True, True))):
            c = _pallas.blocks(op, M, N, dtype, backward=backward, reduces=reduces)
            what = (op.name, dtype, M, N, backward, reduces, num_sms, c)
            assert N <= c.block_n < 2 * N and c.block_n & (c.block_n - 1) == 0, what
            assert c.block_m >= 1 and c.block_m & (c.block_m - 1) == 0, what
            assert c.block_m * c.block_n <= max(16384, c.block_n), what
            assert 1 <= c.num_warps <= 32 and c.block_m * c.block_n <= 128 * 32 * c.num_warps, what
            tiles = -(-M // c.block_m)
            assert 1 <= c.num_programs <= tiles and c.tiles_per_program == -(-tiles // c.num_programs), what
            if reduces:
                assert c.num_programs <= 2 * num_sms, what
                seen.add("partials" if c.tiles_per_program > 1 else "one tile")
            elif c.tiles_per_program > 1:
                assert not op.is_rms and c.num_programs <= 4 * num_sms, what
                seen.add("persistent backward" if backward else "persistent forward")
            else:
                assert c.num_programs == tiles, what
                seen.add("one tile")
    # every branch of the heuristic was met above
    assert seen == {"one tile", "partials", "persistent forward", "persistent backward"}, seen
