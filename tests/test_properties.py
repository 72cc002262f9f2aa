"""Property-based tests: random shapes, dtypes, parameters, trainable sets, casting modes,
offsets and memory layouts, through both frontends (the ``frontend`` fixture; each body is written
once), checked against the float64 reference with outputs poisoned (NaN before every launch).

Every example checks:
- outputs and the gradient of every trained leaf against ``op.run_reference`` (``assert_close``);
- no gradient for a frozen leaf (torch: ``.grad is None``; jax: left out of the vjp, or exactly zero
  when frozen by ``jax_frontend.freeze``);
- no input buffer is modified, padding included: x, residual, weight, bias, and the output
  gradients dy / d_residual_out, compared after the backward with the values before;
- the launch record: one forward (none without rows), a backward only when something is trained,
  with exactly the trained inputs' COMPUTE_* flags, reading y (FROM_Y) exactly where the save rule
  keeps the output (``output_kept``);
- (test_fused_gradients_are_independent only, so that the other properties report the value bugs
  they find) for the fused op with x and residual both trained: their gradients share no storage
  and writing one leaves the other unchanged (torch; JAX arrays are immutable).

The layouts (strided rows, expanded rows and columns, transposed x, the last two leading dims
swapped, sliced and expanded weights, x tied to residual) are built per frontend in tests/layouts.py.
"""
from __future__ import annotations

import dataclasses
import math
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from normkit.ops import OPS, X_DTYPES
from normkit.testing import assert_close, coarser, rounded
from tests import layouts
from tests.frontends import FRONTENDS
from tests.harness import KERNELS, forced_plan, rule_keeps_output

SETTINGS = dict(
    derandomize=True,  # the same examples on every run (from run_property's seed): CI is reproducible
    deadline=None,  # interpreted kernels and a fresh JAX trace per example: some take a second
    database=None,  # no example database (Hypothesis still caches source constants in .hypothesis/)
    suppress_health_check=[HealthCheck.too_slow],
)

CASTINGS = ("llama", "gemma", "none")
# More examples where there is time for them (e.g. NORMKIT_PROPERTY_SCALE=10 on the GPU machine).
SCALE = float(os.environ.get("NORMKIT_PROPERTY_SCALE", "1"))

# Each property runs in two tiers: the default run takes a share of its examples, the slow tier
# (pytest -m slow; .ci/run runs it after the default run) all of them. The JAX frontend takes half
# Torch's share, and its Pallas and XLA implementations no more than its default one: their inputs'
# layouts are the same JAX slicing, and an interpreted example costs them several times as much.
TIERS = [pytest.param("quick"), pytest.param("full", marks=pytest.mark.slow)]
QUICK_SHARE = {"torch": 0.1, "jax": 0.05, "jax-pallas": 0.05, "jax-xla": 0.05}  # the default run: under 10 minutes on 2 cores


def run_property(frontend, tier: str, n: int, strategy, *, explicit=(), independent_grads: bool = False) -> None:
    """``check`` on the examples ``strategy`` draws: ``n`` of them in the full tier (times
    NORMKIT_PROPERTY_SCALE), the frontend's share in the quick one; ``explicit`` examples in both.
    The examples depend on the strategy alone (seeded by its description), so a run is reproducible."""
    share = 1.0 if tier == "full" else QUICK_SHARE[frontend.name]

    @seed(zlib.crc32(repr(strategy).encode()))
    @settings(max_examples=max(1, round(n * share * SCALE)), **SETTINGS)
    @given(spec=strategy)
    def prop(spec):
        check(frontend, spec, independent_grads=independent_grads)

    for spec in explicit:
        prop = example(spec=spec)(prop)
    prop()


@dataclasses.dataclass(frozen=True)
class Spec:
    """One example. Parameter dtypes are None where the parameter is absent."""

    op: str
    shape: tuple  # x's shape (*lead, D); lead has rank 1-3
    dtype: str  # x, residual, dy and d_residual_out
    weight: str | None = None
    bias: str | None = None
    trained: tuple = ()  # the inputs that require a gradient (empty: forward only)
    casting: str = "llama"
    offset: float = 0.0
    x_layout: str = "contiguous"
    residual_layout: str = "contiguous"  # or "tied": residual is x itself
    weight_layout: str = "contiguous"
    bias_layout: str = "contiguous"
    dy_layout: str = "contiguous"
    ds_layout: str = "contiguous"  # d_residual_out, or "absent": only y's gradient flows back
    freeze: bool = False  # jax: freeze the frozen inputs with jax_frontend.freeze (else: leave them out of the vjp)
    save: str = "input"  # what the norm keeps for its backward (the public save= argument)
    seed: int = 0

    @property
    def eps(self) -> float:
        # A column-expanded x has constant rows: LayerNorm's variance is then exactly 0 and the
        # fp32 rounding of the mean is amplified by 1/sqrt(eps) (~316 at 1e-5), for any correct
        # implementation. eps = 1 keeps that case well conditioned; everything else uses the default.
        if self.op == "layer_norm" and self.x_layout == "expanded_col":
            return 1.0
        return OPS[self.op].default_eps

    @property
    def kwargs(self) -> dict:
        """The op's options (as ``Op.options`` takes them)."""
        if OPS[self.op].has_offset:
            return {"eps": self.eps, "offset": self.offset, "casting_mode": self.casting}
        return {"eps": self.eps}

    @property
    def call_kwargs(self) -> dict:
        """The public functions' keywords: the options, and ``save``. Most properties keep the input
        (save="input"): they are about layouts, which the two backward variants read alike (the output
        a frozen norm keeps is its own contiguous buffer). The output-saving backward's own property
        (test_output_saving_layouts_match_reference) passes save="auto" with every parameter frozen; its
        x is never column-expanded (a constant row has x_hat = +-1, where recovering it from y cancels
        like a two-column LayerNorm row; tests/test_save_rule.py)."""
        return {**self.kwargs, "save": self.save}


# ---------------------------------------------------------------------------------------------
# Values: random, exact in their dtype.

VALUES = {
    "x": lambda rng, s: rng.standard_normal(s) * 1.5 + 0.3,
    "residual": lambda rng, s: rng.standard_normal(s),
    "weight": lambda rng, s: rng.uniform(0.5, 1.5, s) * rng.choice([-1.0, 1.0], s),
    "bias": lambda rng, s: rng.standard_normal(s) * 0.5,
    "y": lambda rng, s: rng.standard_normal(s),
    "residual_out": lambda rng, s: rng.standard_normal(s),
}


# ---------------------------------------------------------------------------------------------
# The check, written once.


def check(frontend, spec: Spec, *, independent_grads: bool = False) -> None:
    """``independent_grads``: also assert that x's and residual's gradients are independent tensors
    (checked by its own property, so that the value properties report the bugs they find)."""
    op = OPS[spec.op]
    kit = layouts.kit(frontend)
    rng = np.random.default_rng(spec.seed)
    shape = tuple(spec.shape)
    D, M = shape[-1], math.prod(shape[:-1])
    tied = spec.residual_layout == "tied"
    dtypes = {"x": spec.dtype, "residual": spec.dtype, "weight": spec.weight, "bias": spec.bias}

    def arg(name, kind, dtype, s):
        base = layouts.make_base(kind, s, lambda bs: rounded(VALUES[name](rng, bs), dtype))
        return layouts.Arg(base, dtype, kind, s)

    leaves = {}
    for name in op.inputs:
        if dtypes[name] is None or (name == "residual" and tied):
            continue
        s = shape if name in op.row_inputs else (D,)
        leaves[name] = arg(name, getattr(spec, f"{name}_layout"), dtypes[name], s)
    cotangents = {"y": arg("y", spec.dy_layout, spec.dtype, shape)}
    if op.has_residual and spec.ds_layout != "absent":
        cotangents["residual_out"] = arg("residual_out", spec.ds_layout, spec.dtype, shape)
    trained = frozenset(spec.trained) & set(leaves)

    got = kit.run(spec.op, spec.call_kwargs, leaves, trained, tied, cotangents, "freeze" if spec.freeze else "argnums")

    # The reference, on the values each view holds.
    views = {name: layouts.view_np(a.kind, a.base, a.shape) for name, a in leaves.items()}
    if tied:
        views["residual"] = views["x"]
    cots = {name: layouts.view_np(a.kind, a.base, a.shape) for name, a in cotangents.items()}
    opts = op.options(eps=spec.eps, offset=spec.offset, casting_mode=spec.casting)
    ref_out, ref_grads = op.run_reference(views, opts, cots)

    for name in op.outputs:
        assert_close(got.outputs[name], ref_out[name], spec.dtype, name)
    for name, a in leaves.items():
        if name not in trained:
            assert got.grads[name] is None, f"{name} is frozen but got a gradient"
            continue
        assert got.grads[name] is not None, f"{name} is trained but got no gradient"
        g = ref_grads[name]
        terms = 1
        if tied and name == "x":  # x is also the residual: both gradients flow into it
            g, terms = g + ref_grads["residual"], 2
        reduced = terms * (M if name in op.params else 1)
        tol = spec.dtype if name in op.row_inputs else coarser(spec.dtype, a.dtype)
        assert_close(got.grads[name], g, tol, f"d{name}", reduced_over=reduced)

    # Nothing is written into an input, the output gradients included (padding too).
    for name, a in {**leaves, **cotangents}.items():
        after = got.bases_after[name]
        assert np.array_equal(after, a.base, equal_nan=True), (
            f"{name} ({'d' + name if name in cotangents else 'input'}) was modified in place: "
            f"{int(np.sum(~((after == a.base) | (np.isnan(after) & np.isnan(a.base)))))} elements changed")

    # The launches: only what the trained set asks for, and the backward from what the rule keeps.
    backward = check_launches(got.log, M, trained)
    if backward is not None:
        kept = output_kept(spec, views, trained, traced=frontend.name.startswith("jax"))
        assert backward.flags["FROM_Y"] == kept, f"the backward read {'xy'[backward.flags['FROM_Y']]}, the rule keeps {'xy'[kept]}"

    # dy is read in place (by three row indices where its leading dims need them) unless its last dim
    # is not contiguous.
    assert spec.dy_layout == "transposed" or "the output gradient" not in got.copied, got.copied

    # Last (so that a wrong value is reported first): x's and residual's gradients are independent.
    if independent_grads and {"x", "residual"} <= trained:
        got.check_independent()


def output_kept(spec: Spec, views: dict, trained: frozenset, *, traced: bool) -> bool:
    """Whether the norm keeps its output y for the backward: save="auto", every parameter frozen, x (or
    the residual) trained, and the save rule (``harness.rule_keeps_output``) on the example's weight and
    bias, or, where the values are unseen (JAX, under ``jit``), ``saving.traced_rule``."""
    op = OPS[spec.op]
    if spec.save == "input" or set(op.params) & trained or not set(op.row_inputs) & trained:
        return False
    opts = op.options(eps=spec.eps, offset=spec.offset, casting_mode=spec.casting)
    return rule_keeps_output(op, spec.shape[-1], views.get("weight"), views.get("bias"), x_dtype=spec.dtype,
                             opts=opts, traced=traced)


def check_launches(log, M: int, trained: frozenset):
    """Asserts the launches; returns the backward's launch (None where there is none)."""
    if M == 0:
        assert log.kernels() == [], f"launches without rows: {log.kernels()}"
        return None
    implementations = {launch.implementation for launch in log}
    assert len(implementations) == 1, implementations
    fwd_name, bwd_name, red_name = KERNELS[implementations.pop()]
    fwd, bwd = log.of(fwd_name), log.of(bwd_name)
    assert len(fwd) == 1, log.kernels()
    assert fwd[0].flags["STORE_STATS"] == bool(trained), fwd[0].flags
    if not trained:
        assert not bwd, log.kernels()
        return None
    assert len(bwd) == 1, log.kernels()
    flags = bwd[0].flags
    assert flags["COMPUTE_DX"] == bool({"x", "residual"} & trained), flags
    assert flags["COMPUTE_DW"] == ("weight" in trained), flags
    assert flags["COMPUTE_DB"] == ("bias" in trained), flags
    reduces = ("weight" in trained) or ("bias" in trained)
    assert len(log.of(red_name)) == int(reduces) if red_name else not bwd[0].partial_buffers, log.kernels()
    return bwd[0]


# ---------------------------------------------------------------------------------------------
# Strategies.


@st.composite
def shapes(draw, d_range=(1, 300)):
    """(*lead, D): lead of rank 1-3 with at most 27 rows, about one in ten without rows (a leading
    dim of 0, which passes without a launch, so drawing it as often as the others would waste
    examples); D in ``d_range`` (from 1 to 300)."""
    rank = draw(st.integers(1, 3))
    lead = [draw(st.integers(1, {1: 12, 2: 5, 3: 3}[rank])) for _ in range(rank)]
    if draw(st.integers(0, 9)) == 0:
        lead[draw(st.integers(0, rank - 1))] = 0
    return tuple(lead) + (draw(st.integers(*d_range)),)


@st.composite
def specs(draw, *, ops=tuple(OPS), row_layouts=("contiguous",), param_layouts=("contiguous",), tie=False,
          param_dtypes=None, train=(), need_weight=False, d_range=(1, 300), frozen_params=False, save="input"):
    """A Spec. ``param_dtypes``: the dtypes a present weight / bias draws from (default: x's dtype or
    another supported one); ``train``: inputs that are always trained; ``need_weight``: always a weight;
    ``d_range``: the row length's range; ``frozen_params``: weight and bias never trained; ``save``: the
    call's save=."""
    op = OPS[draw(st.sampled_from(ops))]
    shape = draw(shapes(d_range))
    dtype = draw(st.sampled_from(X_DTYPES))
    choices = param_dtypes or (dtype,) + tuple(d for d in X_DTYPES if d != dtype)  # shrinks to x's dtype

    def param(name):
        if name not in op.params or not (name == "weight" and need_weight or draw(st.booleans())):
            return None
        return draw(st.sampled_from(choices))

    weight, bias = param("weight"), param("bias")  # the dtypes, None where absent
    kw = {}
    # Drawn early: Hypothesis fills the last draws of an example with their simplest values more often.
    present = [n for n in op.inputs if n in op.row_inputs or {"weight": weight, "bias": bias}[n]]
    # Any subset, {} included; a draw says "frozen", so that examples shrink towards training everything.
    trained = {name for name in present if name in train or not (frozen_params and name in op.params or draw(st.booleans()))}
    if op.has_residual and tie and draw(st.booleans()):
        kw["residual_layout"] = "tied"  # one tensor: residual is trained exactly when x is
        trained = (trained - {"residual"}) | ({"residual"} if "x" in trained else set())
    kw.update(x_layout=draw(st.sampled_from(row_layouts)), dy_layout=draw(st.sampled_from(row_layouts)))
    if op.has_residual:
        if "residual_layout" not in kw:
            kw["residual_layout"] = draw(st.sampled_from(row_layouts))
        kw["ds_layout"] = draw(st.sampled_from(row_layouts + ("absent",)))
    if weight:
        kw["weight_layout"] = draw(st.sampled_from(param_layouts))
    if bias:
        kw["bias_layout"] = draw(st.sampled_from(param_layouts))
    if op.has_offset:
        kw.update(casting=draw(st.sampled_from(CASTINGS)), offset=draw(st.sampled_from((0.0, 1.0))))
    return Spec(op.name, shape, dtype, weight, bias, tuple(sorted(trained)), freeze=draw(st.booleans()),
                save=save, seed=draw(st.integers(0, 2**16)), **kw)


# ---------------------------------------------------------------------------------------------
# Properties.


@pytest.mark.parametrize("tier", TIERS)
def test_contiguous_inputs_match_reference(frontend, tier):
    """Shapes (M = 0, D = 1, rank 1-3 leading dims), dtypes, weight/bias presence and dtype, every
    trainable subset (none: forward only), casting modes and offsets; contiguous inputs."""
    run_property(frontend, tier, 200, specs(), explicit=[
        Spec("layer_norm", (0, 3, 5), "float32", "float32", "float32", trained=("bias", "weight", "x")),
        Spec("fused_add_rms_norm", (4, 1), "bfloat16", "bfloat16", trained=("weight", "x"), casting="gemma",
             offset=1.0, freeze=True),
        Spec("rms_norm", (2, 1, 3, 7), "float16", "float32", trained=("weight",), casting="none"),
    ])


@pytest.mark.parametrize("tier", TIERS)
def test_row_layouts_match_reference(frontend, tier):
    """x, residual (or x itself), dy and d_residual_out: strided rows, expanded rows / columns,
    transposed-then-sliced, the last two leading dims swapped (a [B, S, H, D] view of a [B, H, S, D]
    dy: rows of three indices); contiguous weight and bias."""
    run_property(frontend, tier, 200, specs(row_layouts=layouts.ROW_LAYOUTS, tie=True), explicit=[
        Spec("rms_norm", (2, 3, 4, 16), "bfloat16", "bfloat16", trained=("x",), dy_layout="swapped_lead"),
        Spec("layer_norm", (2, 3, 2, 24), "float32", "float32", "float32", trained=("bias", "weight", "x"),
             dy_layout="swapped_lead"),
    ])


@pytest.mark.parametrize("tier", TIERS)
def test_param_layouts_match_reference(frontend, tier):
    """weight and bias sliced (w_big[::2], w_big[1::3]) or expanded (stride 0); contiguous rows."""
    run_property(frontend, tier, 150, specs(param_layouts=layouts.PARAM_LAYOUTS, need_weight=True))


@pytest.mark.parametrize("tier", TIERS)
def test_any_layouts_match_reference(frontend, tier):
    """Every layout at once."""
    run_property(frontend, tier, 150, specs(row_layouts=layouts.ROW_LAYOUTS, param_layouts=layouts.PARAM_LAYOUTS,
                                            tie=True))


@pytest.mark.parametrize("tier", TIERS)
def test_output_saving_layouts_match_reference(frontend, tier):
    """save="auto" (the default) with every parameter frozen and x trained: weight and bias sliced or
    expanded, x, residual (or x itself), dy and d_residual_out strided, expanded by rows, transposed or
    with two leading dims swapped. The backward reads y where the safety rule keeps it (on the values,
    or traced: ``saving.traced_rule``), x elsewhere; every output and gradient against float64."""
    rows = tuple(kind for kind in layouts.ROW_LAYOUTS if kind != "expanded_col")
    run_property(frontend, tier, 120, specs(row_layouts=rows, param_layouts=layouts.PARAM_LAYOUTS, tie=True,
                                            train=("x",), frozen_params=True, save="auto"), explicit=[
        Spec("layer_norm", (3, 40), "bfloat16", "bfloat16", "bfloat16", trained=("x",), weight_layout="slice3",
             bias_layout="expanded", dy_layout="strided_rows", save="auto"),
        Spec("rms_norm", (2, 3, 4, 16), "float32", "float32", trained=("x",), weight_layout="slice2",
             dy_layout="swapped_lead", save="auto"),
        Spec("fused_add_rms_norm", (5, 24), "bfloat16", "float32", trained=("residual", "x"),
             residual_layout="tied", weight_layout="expanded", ds_layout="transposed", save="auto"),
    ])


@pytest.mark.parametrize("tier", TIERS)
def test_fused_gradients_are_independent(frontend, tier):
    """fused_add_rms_norm with x and residual both trained (distinct tensors): right gradients, and
    (torch) x.grad and residual.grad share no storage."""
    run_property(frontend, tier, 80, specs(ops=("fused_add_rms_norm",), row_layouts=layouts.ROW_LAYOUTS,
                                           train=("x", "residual")), independent_grads=True)


@pytest.mark.parametrize("tier", TIERS)
def test_float64_params_match_reference(frontend, tier):
    """A float64 weight / bias, which every frontend and implementation accepts: outputs and gradients
    against the reference."""
    run_property(frontend, tier, 30, specs(param_dtypes=("float64",), need_weight=True))


class _HalfRows(dict):
    """A ``launch._RMS_FWD_TILES`` that plans every RMSNorm row of >= 32 columns in two passes over
    half-row chunks, on the tiles it would otherwise have."""

    def get(self, key, default):
        block_m, num_warps, _ = default
        return block_m, num_warps, key[2] // 2 if key[2] >= 32 else 0


class _HalfRowsBackward(dict):
    """A ``launch._BWD_TILES`` that plans every dx-only backward over rows of >= 32 columns in two
    passes over half-row chunks, from the input and from the output alike."""

    def get(self, key, default):
        num_warps, _, per_sm, stages, rows, _ = default
        return num_warps, key[3] // 2 if key[3] >= 32 else 0, per_sm, stages, rows, 0


# the frontends that launch the Triton kernels (jax: its default implementation, Triton where it can run)
TRITON_FRONTENDS = pytest.mark.parametrize("frontend", [n for n in ("jax", "torch") if n in FRONTENDS], indirect=True)


@pytest.fixture
def two_pass_rows(monkeypatch, frontend):
    """The RMSNorm forwards planned in two passes over chunks (``CHUNK_N``)."""
    yield from forced_plan(monkeypatch, frontend, "_RMS_FWD_TILES", _HalfRows(), "norm_fwd_kernel",
                           lambda flags: flags["CHUNK_N"] > 0)


class _PersistentBackward(dict):
    """A ``launch._BWD_TILES`` that plans every dx-only backward on a persistent grid of one program
    per 50 SMs (at least one: the interpreter's 4 "SMs" get one, an H200's 132 three), each looping
    over its tiles with the next two prefetched."""

    def get(self, key, default):
        num_warps, chunk, _, _, rows, per_tile = default
        return num_warps, chunk, 0.02, 3, rows, per_tile


class _RowsBackward(dict):
    """A ``launch._BWD_TILES`` that plans every dx-only backward over rows of 2048 to 8192 columns in
    tiles of 4 rows (tile_config's hold 1 or 2), one program per tile, at twice the warps."""

    def get(self, key, default):
        return (min(32, 2 * default[0]), 0, 0, 1, 4, 0) if 2048 <= key[3] <= 8192 else default


class _PerTileBackward(dict):
    """A ``launch._BWD_TILES`` that plans every output-saving backward in one pass with the parameters
    loaded in each tile (``PARAMS_PER_TILE``), on a persistent grid where ``persistent`` (as
    ``_PersistentBackward``'s), else one program per tile (tests/test_save_rule.py: these properties
    keep the input)."""

    def __init__(self, persistent: bool):
        super().__init__()
        self.persistent = persistent

    def get(self, key, default):
        if not key[1]:  # from the input: as planned
            return default
        num_warps, _, per_sm, stages, rows, _ = default
        return (num_warps, 0, 0.02, 3, rows, 1) if self.persistent else (num_warps, 0, 0, 1, rows, 1)


@pytest.fixture
def persistent_backward(monkeypatch, frontend):
    """Every dx-only backward planned on a persistent grid (programs loop over tiles)."""
    yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _PersistentBackward(), "norm_bwd_kernel",
                           lambda flags: flags["PERSISTENT"])


@pytest.fixture
def rows_backward(monkeypatch, frontend):
    """Every dx-only backward over rows of 2048 to 8192 columns planned in tiles of 4 rows."""
    yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _RowsBackward(), "norm_bwd_kernel",
                           lambda flags: flags["BLOCK_M"] == 4 and flags["BLOCK_N"] >= 2048)


@pytest.fixture
def two_pass_backward(monkeypatch, frontend):
    """Every dx-only backward planned in two passes over chunks (the backward's ``CHUNK_N``)."""
    yield from forced_plan(monkeypatch, frontend, "_BWD_TILES", _HalfRowsBackward(), "norm_bwd_kernel",
                           lambda flags: flags["CHUNK_N"] > 0)


@pytest.fixture
def looped_tiles(monkeypatch, frontend):
    """Every forward planned on a persistent grid of one-row tiles, so that each program loops over
    several tiles with the next ones prefetched (the kernel's tile loop; the plans' own tiles mostly
    run loop-free, one program per tile)."""
    from normkit import launch

    planned = launch.forward_tile

    def persistent(op, M, N, elem_bytes):
        _, block_n, num_warps, _, chunk = planned(op, M, N, elem_bytes)
        return 1, block_n, num_warps, True, chunk

    yield from forced_plan(monkeypatch, frontend, "forward_tile", persistent, "norm_fwd_kernel",
                           lambda flags: flags["LOOP_STAGES"] > 1)


@TRITON_FRONTENDS
@pytest.mark.parametrize("tier", TIERS)
def test_two_pass_rows_match_reference(frontend, tier, two_pass_rows):
    """RMSNorm and the fused add with rows read in two passes over chunks (the forward's ``CHUNK_N``,
    forced for every row of >= 32 columns): every row layout, the residual tied to x, parameter
    layouts, casting modes and offsets."""
    run_property(frontend, tier, 60, specs(ops=("rms_norm", "fused_add_rms_norm"), row_layouts=layouts.ROW_LAYOUTS,
                                           param_layouts=layouts.PARAM_LAYOUTS, tie=True), explicit=[
        Spec("fused_add_rms_norm", (3, 5, 200), "bfloat16", "float32", trained=("residual", "x"), casting="none"),
        Spec("rms_norm", (7, 64), "float32", "bfloat16", trained=("weight",), offset=1.0, x_layout="strided_rows"),
    ])


@TRITON_FRONTENDS
@pytest.mark.parametrize("tier", TIERS)
def test_two_pass_backward_matches_reference(frontend, tier, two_pass_backward):
    """Every op's dx-only backward with rows read in two passes over chunks (``CHUNK_N``, forced for
    every row of >= 32 columns): every row layout, the residual tied to x, parameter layouts, casting
    modes and offsets (the output-saving backward's two passes: tests/test_save_rule.py)."""
    run_property(frontend, tier, 60, specs(row_layouts=layouts.ROW_LAYOUTS, param_layouts=layouts.PARAM_LAYOUTS,
                                           tie=True), explicit=[
        Spec("layer_norm", (5, 200), "bfloat16", "bfloat16", "float32", trained=("x",), x_layout="strided_rows"),
        Spec("fused_add_rms_norm", (3, 5, 64), "float16", "float32", trained=("residual", "x"), casting="none"),
        Spec("rms_norm", (7, 96), "float32", "bfloat16", trained=("x",), offset=1.0),
    ])


@TRITON_FRONTENDS
@pytest.mark.parametrize("tier", TIERS)
def test_persistent_backward_matches_reference(frontend, tier, persistent_backward):
    """Every op's dx-only backward on a persistent grid (each program loops over several tiles, the
    next ones prefetched; forced for every shape): every row layout, the tie, parameter layouts."""
    run_property(frontend, tier, 60, specs(row_layouts=layouts.ROW_LAYOUTS, param_layouts=layouts.PARAM_LAYOUTS,
                                           tie=True), explicit=[
        Spec("layer_norm", (9, 2048), "bfloat16", "bfloat16", "float32", trained=("x",)),
        Spec("fused_add_rms_norm", (3, 2, 4096), "float32", "float32", trained=("residual",), x_layout="strided_rows"),
    ])


@TRITON_FRONTENDS
@pytest.mark.parametrize("tier", TIERS)
def test_backward_tiles_of_several_rows_match_reference(frontend, tier, rows_backward):
    """Every op's dx-only backward over 4-row tiles where its own tiles hold 1 or 2 rows (rows of 2048
    to 8192 columns; a block of rows past M masked): row layouts, the tie, parameter layouts."""
    run_property(frontend, tier, 16, specs(row_layouts=layouts.ROW_LAYOUTS, param_layouts=layouts.PARAM_LAYOUTS,
                                           tie=True, train=("x",), d_range=(2048, 4100)), explicit=[
        Spec("layer_norm", (7, 2048), "bfloat16", "bfloat16", "float32", trained=("x",)),
        Spec("rms_norm", (5, 4097), "float32", "float32", trained=("x",), x_layout="strided_rows"),
        Spec("fused_add_rms_norm", (3, 2, 2100), "bfloat16", "float32", trained=("residual", "x")),
    ])


@TRITON_FRONTENDS
@pytest.mark.parametrize("tier", TIERS)
def test_looped_tiles_match_reference(frontend, tier, looped_tiles):
    """Every op with each program looping over several one-row tiles (the forward's persistent,
    prefetching grid, forced for every shape): every row layout, the tie, parameter layouts."""
    run_property(frontend, tier, 60, specs(row_layouts=layouts.ROW_LAYOUTS, param_layouts=layouts.PARAM_LAYOUTS,
                                           tie=True), explicit=[
        Spec("layer_norm", (40, 96), "bfloat16", "bfloat16", "float32", trained=("bias", "weight", "x")),
        Spec("fused_add_rms_norm", (3, 11, 64), "float32", "float32", trained=("x",), x_layout="strided_rows"),
    ])


# ---------------------------------------------------------------------------------------------
# The forward's copy of y (HAS_Y2: y stored a second time, widened, by the same pass), on each tile
# shape, forced through ``normkit.launch.forward_tile``: the kernel's own Y2 against Y.

def _tile_forced(tile: str):
    """A ``launch.forward_tile`` giving every plan the tile ``tile``: "one_pass" (rows in registers),
    "two_pass" (RMSNorm's rows read twice over half-row chunks) or "looped" (a persistent grid of
    one-row tiles, each program looping over several)."""
    from normkit import launch

    planned = launch.forward_tile

    def forced(op, M, N, elem_bytes):
        block_m, block_n, num_warps, _, _ = planned(op, M, N, elem_bytes)
        if tile == "looped":
            return 1, block_n, num_warps, True, 0
        return block_m, block_n, num_warps, False, block_n // 2 if tile == "two_pass" else 0

    return forced


TILE_FLAGS = {"one_pass": lambda f: f["CHUNK_N"] == 0 and f["LOOP_STAGES"] == 0,
              "two_pass": lambda f: f["CHUNK_N"] > 0, "looped": lambda f: f["LOOP_STAGES"] > 1}
# (x's dtype, the copy's dtype): bf16 and fp16 widened to fp32, fp32 in fp32, and to fp64
COPY_DTYPES = [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float32"), ("bfloat16", "float64"),
               ("float32", "float64")]


def _bits(t):
    """A tensor's bits, as integers of its element size: equal bits, not merely equal values."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("op,tile", [(op, tile) for op in sorted(OPS) for tile in sorted(TILE_FLAGS)
                                     if tile != "two_pass" or OPS[op].is_rms])  # LayerNorm: no two-pass tile
def test_the_forwards_copy_of_y_is_y_widened_on_every_tile(op, tile, monkeypatch):
    """``norm_fwd_kernel`` with HAS_Y2 (the forward of ``driver.forward(..., y2_dtype=...)``, through the
    Torch backend, outputs poisoned): Y2 is ``Y.to(Y2's dtype)`` bit for bit, Y and S are bitwise
    those of the same plan without Y2, and Y is the float64 reference's; on 24 rows (the looped grid's
    programs take several tiles), contiguous or sliced out of wider rows, with statistics and the
    weight's recovery stored or not."""
    torch = pytest.importorskip("torch")
    import normkit
    from normkit import driver, launch
    from normkit.testing import poisoned_outputs, random_inputs
    from torch_frontend._backend import BACKEND, TORCH_DTYPES

    spec = OPS[op]
    M, N = 24, 64
    launch.plan_forward.cache_clear()
    try:
        with monkeypatch.context() as m, poisoned_outputs():
            m.setattr(launch, "forward_tile", _tile_forced(tile))
            for i, (x_dtype, y2_dtype) in enumerate(COPY_DTYPES):
                rng = np.random.default_rng(zlib.crc32(f"{op} {tile} {x_dtype} {y2_dtype}".encode()))
                inp = random_inputs(spec, (M, N), x_dtype, rng)
                dt = TORCH_DTYPES[x_dtype]
                sliced = i % 2 == 1  # rows of a wider array: run-time row strides (ROWS_CONTIGUOUS off)

                def rows(a):
                    t = torch.tensor(a, dtype=dt)
                    if sliced:
                        t = torch.cat([t, torch.randn(M, 16, dtype=dt)], dim=1)[:, :N]
                    return t

                x, r = rows(inp["x"]), rows(inp["residual"]) if spec.has_residual else None
                w = torch.tensor(inp["weight"], dtype=dt)
                b = torch.tensor(inp["bias"], dtype=dt) if "bias" in inp else None
                opts = spec.options(eps=spec.default_eps)
                rec = i % 3 == 0  # the output-keeping forward's extra work beside it
                with normkit.record_launches() as log:
                    y, s, mean, rstd, _, y2 = driver.forward(BACKEND, spec, x, r, w, b, opts, True, rec, rec,
                                                             y2_dtype)
                    y_alone, s_alone, *_, none = driver.forward(BACKEND, spec, x, r, w, b, opts, True, rec, rec)
                (with_y2, without) = log.of("norm_fwd_kernel")
                assert with_y2.flags["HAS_Y2"] and not without.flags["HAS_Y2"] and none is None
                assert TILE_FLAGS[tile](with_y2.flags) and (with_y2.flags["ROWS_CONTIGUOUS"] is not sliced), with_y2
                what = f"{op} {tile} {x_dtype} -> {y2_dtype}, sliced={sliced}"
                assert y2.dtype == TORCH_DTYPES[y2_dtype] and y2.shape == y.shape and y2.is_contiguous(), what
                assert torch.isfinite(y).all() and torch.equal(_bits(y2), _bits(y.to(y2.dtype))), what
                assert torch.equal(_bits(y), _bits(y_alone)), what
                outs, _ = spec.run_reference({k: inp[k] for k in spec.inputs}, opts,
                                             {"y": inp["dy"], "residual_out": inp.get("ds")})
                assert_close(y.double().numpy(), outs["y"], x_dtype, what)
                if spec.has_residual:
                    assert torch.equal(_bits(s), _bits(s_alone)), what
                    assert_close(s.double().numpy(), outs["residual_out"], x_dtype, what)
    finally:
        launch.plan_forward.cache_clear()
