"""Launch plans: invariants of the one launch heuristic (``normkit.launch``)."""
import itertools

import pytest

from normkit import launch
from normkit.ops import OPS, Grads


def _unbounded_caches():
    return [f for f in vars(launch).values() if hasattr(f, "cache_info") and f.cache_parameters()["maxsize"] is None]


def test_unbounded_caches_do_not_grow_with_the_row_count():
    """A training loop with variable sequence lengths plans a new row count at every step: nothing
    cached without bound may grow with it."""
    for f in _unbounded_caches():
        f.cache_clear()
    for M in range(1, 3000):
        launch.tile_config(M, 4096)
        launch.tile_config(M, 96)
    assert sum(f.cache_info().currsize for f in _unbounded_caches()) <= 16


@pytest.mark.parametrize("N", [1, 96, 4096, 8192, 65536])
def test_tiles_cover_the_row_and_stay_within_one_program(N):
    for M in (1, 3, 16, 17, 1000, 100_000):
        block_m, block_n, warps = launch.tile_config(M, N)
        assert block_n >= N and block_n & (block_n - 1) == 0  # a power of two covering the row
        assert block_m & (block_m - 1) == 0  # whole powers of two
        assert block_m * block_n <= max(4096, block_n)  # one tile of ~4096 elements, or one long row
        assert 4 <= warps <= 32


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_forward_tiles_cover_the_row_with_work_for_every_thread(op, elem_bytes):
    """The forward's own tiles (``forward_tile``): a power-of-two row block covering the row, at
    most 16 rows, no more than 16384 elements unless one row is longer, and at least one element per
    thread."""
    spec = OPS[op]
    for M, N in itertools.product((1, 3, 16, 17, 1000, 100_000), (1, 96, 1000, 2048, 4096, 8192, 65536)):
        block_m, block_n, warps, persistent, chunk = launch.forward_tile(spec, M, N, elem_bytes)
        what = (M, N, block_m, block_n, warps)
        assert block_n >= N and block_n & (block_n - 1) == 0, what
        assert block_m & (block_m - 1) == 0 and block_m <= 16, what
        assert block_m * block_n <= max(16384, block_n), what
        assert 4 <= warps <= 32 and (block_m * block_n >= 32 * warps or warps == 4), what
        assert not persistent or not spec.is_rms, what
        assert chunk == 0 or spec.is_rms and not persistent and block_n % chunk == 0 and chunk < block_n, what
        assert chunk == 0 or block_m * chunk >= 32 * warps, what  # each chunk too has work for every thread


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_a_rows_tile_does_not_depend_on_the_row_count(op, elem_bytes):
    """Batch invariance: a row's reduction order follows its tile's layout, so the tiles (and warps)
    of the forward and of the dx-only backward are a function of N alone, the same for one row as
    for a hundred thousand."""
    spec = OPS[op]
    opts = spec.options(eps=spec.default_eps)
    dtype = {2: "bfloat16", 4: "float32"}[elem_bytes]
    for N in (1, 96, 128, 1000, 1024, 2048, 4096, 8192, 65536):
        tiles = {launch.forward_tile(spec, M, N, elem_bytes) for M in (1, 2, 3, 16, 17, 1000, 100_000)}
        assert len(tiles) == 1, (N, tiles)
        bwd = set()
        for M in (1, 2, 3, 16, 17, 1000, 100_000):
            call, _ = launch.plan_backward(spec, M, N, dtype, dtype, None, False, opts, Grads(dx=True, dw=False),
                                           (N, 1, N, 1, N, 1, 1, 1), 132)
            bwd.add((call.num_warps, call.constexprs["BLOCK_M"], call.constexprs["BLOCK_N"]))
        assert len(bwd) == 1, (N, bwd)


@pytest.mark.parametrize("op", sorted(OPS))
def test_frozen_backward_plans_allocate_no_partials(op):
    spec = OPS[op]
    opts = spec.options(eps=spec.default_eps)
    layout = (4096, 1, 4096, 1, 0, 1, 1, 1)
    bwd, reduce = launch.plan_backward(spec, 8192, 4096, "bfloat16", "bfloat16", None, False, opts,
                                       Grads(dx=True, dw=False), layout, 132)
    assert reduce is None and not any(name.endswith("_PART") for name in bwd.out_specs)
    bwd, reduce = launch.plan_backward(spec, 8192, 4096, "bfloat16", "bfloat16", None, False, opts,
                                       Grads(dx=True, dw=True), layout, 132)
    assert reduce is not None and "DW_PART" in bwd.out_specs


@pytest.mark.parametrize("op", sorted(OPS))
def test_grids_cover_the_rows_with_few_partials(op):
    """Plans of every pass, from one row to many and short rows to the longest, on a few SMs or many:
    the forward and a backward without dW/dB run one program per tile (LayerNorm's forward on long
    16-bit rows: at most 4 per SM, each walking several tiles and prefetching); a backward with dW/dB
    runs at most 2 programs per SM, one fp32 partial row each, and the reduction covers every column
    of those partials."""
    spec = OPS[op]
    opts = spec.options(eps=spec.default_eps)
    for num_sms, M, N in itertools.product((4, 132), (1, 17, 300, 100_000), (1, 96, 4096, 65536)):
        for dtype in ("bfloat16", "float32"):
            fwd = launch.plan_forward(spec, M, N, dtype, dtype, None, opts, True, (N, 1, N, 1, 1, 1), num_sms)
            tiles = -(-M // fwd.constexprs["BLOCK_M"])
            assert 1 <= fwd.grid[0] <= tiles and (
                fwd.grid == (tiles,) or not spec.is_rms and fwd.grid[0] <= 4 * num_sms), (M, N, num_sms, fwd.grid)
            assert fwd.grid == (tiles,) or fwd.constexprs["LOOP_STAGES"] > 1  # a persistent grid prefetches
            # the loop-free kernel (LOOP_STAGES 0) runs one tile per program: its grid must cover them all
            assert fwd.constexprs["LOOP_STAGES"] != 0 or fwd.grid == (tiles,), (M, N, num_sms, fwd.grid)
        for grads in (Grads(dx=True, dw=False), Grads(dx=False, dw=True), Grads(dx=True, dw=True)):
            bwd, red = launch.plan_backward(spec, M, N, "bfloat16", "bfloat16", None, spec.has_residual, opts, grads,
                                            (N, 1, N, 1, N, 1, 1, 1), num_sms)
            tiles = -(-M // bwd.constexprs["BLOCK_M"])
            G = bwd.grid[0]
            what = (M, N, num_sms, grads, G)
            if not grads.reduces:
                assert bwd.grid == (tiles,) and red is None, what
                continue
            assert 1 <= G <= min(tiles, 2 * num_sms) and bwd.out_specs["DW_PART"] == ((G, N), "float32"), what
            block_n = red.constexprs["BLOCK_N"]
            assert red.scalars == (G,) and red.grid[0] * block_n >= N > (red.grid[0] - 1) * block_n, what


def test_the_forwards_copy_of_y_is_asked_only_in_a_dtype_that_holds_y():
    """``y2_dtype`` (the forward also stores y in that dtype, Y2) is x's own dtype or a wider float: a
    copy in any other dtype would round y, so the driver refuses it before planning (rows or none);
    the plan of a copy is keyed apart from the plan without one."""
    torch = pytest.importorskip("torch")
    from normkit import driver
    from normkit.ops import copies_exactly
    from torch_frontend._backend import BACKEND

    holds = {(x, c) for x in ("bfloat16", "float16", "float32") for c in ("bfloat16", "float16", "float32", "float64")
             if copies_exactly(x, c)}
    assert holds == {("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "float64"),
                     ("float16", "float16"), ("float16", "float32"), ("float16", "float64"),
                     ("float32", "float32"), ("float32", "float64")}
    spec = OPS["rms_norm"]
    opts = spec.options(eps=spec.default_eps)
    for x_dtype, y2_dtype in (("float32", "bfloat16"), ("bfloat16", "float16"), ("float16", "bfloat16")):
        for M in (0, 3):
            x = torch.randn(M, 8).to(getattr(torch, x_dtype))
            with pytest.raises(TypeError, match=f"cannot write a {y2_dtype} copy of a {x_dtype} output"):
                driver.forward(BACKEND, spec, x, None, None, None, opts, False, y2_dtype=y2_dtype)
    layout = (64, 1, 0, 1, 1, 1)
    plain = launch.plan_forward(spec, 8, 64, "bfloat16", "bfloat16", None, opts, True, layout, 4)
    copying = launch.plan_forward(spec, 8, 64, "bfloat16", "bfloat16", None, opts, True, layout, 4, y2_dtype="float32")
    assert plain is not copying and not plain.constexprs["HAS_Y2"] and copying.constexprs["HAS_Y2"]
    assert set(copying.out_specs) - set(plain.out_specs) == {"Y2"}


def test_nested_launch_records_close_in_any_state():
    """``record_launches`` blocks nest: a launch reaches every open block, and closing the inner block
    (whose log then equals the outer one's) leaves the outer one recording."""
    import normkit
    from normkit import record

    def launch(name):
        record.emit(record.Launch(kernel=name, frontend="torch", grid=(1,), num_warps=4, flags={},
                                  partial_buffers=(), interpreted=True))

    with normkit.record_launches() as outer:
        with normkit.record_launches() as inner:
            launch("a")
        assert inner == outer and inner.kernels() == ["a"]
        launch("b")
        with normkit.record_launches() as empty:
            pass
        assert empty == []
    launch("c")  # after both blocks: recorded nowhere
    assert outer.kernels() == ["a", "b"] and inner.kernels() == ["a"]
    assert not record.active()
