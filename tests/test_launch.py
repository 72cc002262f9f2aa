"""Launch plans: invariants of the one launch heuristic (``normkit.launch``)."""
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
        assert block_m & (block_m - 1) == 0 and block_m < 2 * M  # whole powers of two, not past the rows
        assert block_m * block_n <= max(4096, block_n)  # one tile of ~4096 elements, or one long row
        assert 4 <= warps <= 32


@pytest.mark.parametrize("op", sorted(OPS))
def test_frozen_backward_plans_allocate_no_partials(op):
    spec = OPS[op]
    opts = spec.options(eps=spec.default_eps)
    layout = (4096, 1, 4096, 1, 0, 1, 1)
    bwd, reduce = launch.plan_backward(spec, 8192, 4096, "bfloat16", "bfloat16", None, False, opts,
                                       Grads(dx=True, dw=False), layout, 132)
    assert reduce is None and not any(name.endswith("_PART") for name in bwd.out_specs)
    bwd, reduce = launch.plan_backward(spec, 8192, 4096, "bfloat16", "bfloat16", None, False, opts,
                                       Grads(dx=True, dw=True), layout, 132)
    assert reduce is not None and "DW_PART" in bwd.out_specs
