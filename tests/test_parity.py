"""Parity with the float64 reference for every op, dtype, casting mode, offset, parameter set,
frozen set and shape; the launch record must show exactly the requested backward variant.

Torch and the JAX frontend's default implementation run every case; the JAX frontend's other
implementations (Pallas, XLA) run every combination on fewer shapes: D = 1, several row tiles and
programs (the dW/dB partials), and an odd D above 4096; at the large GPU-only shapes, in the default
casting without offset (their default run also meets the other shapes). The body is the same for
all of them.

The default run takes ``quick_cases`` (tests/harness.py): every variant once, at a rotating shape
(every shape but the two costliest: ``ROTATION``), and every shape with every op
and dtype, frozen and not. That still meets every kernel flag combination, every frozen set and every
shape through Torch and the JAX frontend, and every kernel flag combination (in the default casting;
each casting mode and offset with every op and dtype) and every shape through the Pallas and XLA
implementations. The other cases are marked ``slow`` (run after the default run by .ci/run, and by
scripts/gpu-check.sh). fp32 cases that only repeat the default casting (``repeats_default_casting``)
are left out.
"""
import os
import zlib

import numpy as np
import pytest

from normkit.shapes import shapes
from tests.frontends import FRONTENDS
from tests.harness import (DEFAULT_CASTING_MODE, check_against_reference, check_launch_flags, make_inputs,
                           parity_cases, quick_cases, reference, repeats_default_casting)

SIZE_TAG = os.environ.get("NORMKIT_TEST_SHAPES", "ci")  # "gpu" on the GPU machine: larger shapes too
SHAPES = shapes("ci", "gpu") if SIZE_TAG == "gpu" else shapes("ci")  # each shape once
CASES = [c for c in parity_cases(SHAPES) if not repeats_default_casting(c)]
# The variants rotate through every shape but the two whose rows cost the interpreter most (300 rows,
# rows of 4097): those meet every op and dtype, full and frozen, like every shape, and every variant
# in the slow tier.
ROTATION = [s for s in SHAPES if s.name not in ("many_rows", "d4097")]
QUICK = set(quick_cases(SHAPES, rotate_over=ROTATION))
FEWER_SHAPES = [s for s in SHAPES if s.name in ("d1", "many_rows", "d4097") or s.tags == frozenset({"gpu"})]
# The other implementations at the large GPU-only shapes (tiling, many programs, wide rows): every op,
# dtype, parameter set and frozen set, in the default casting without offset (the casting modes and
# the offset run at the small shapes, where they cost nothing).
OTHER_CASES = [c for c in parity_cases(FEWER_SHAPES) if not repeats_default_casting(c)
               and (c.shape.tags != frozenset({"gpu"}) or (c.casting, c.offset) == ("llama", 0.0))]
# Their default run: one frozen set per kernel variant of the default casting (the frontend's routing
# of the others runs through "jax"), each other casting mode and offset once per op and dtype,
# rotating over the shapes of ``ROTATION``; the full and frozen backward at the fewer shapes.
OTHER_QUICK = set(quick_cases(SHAPES, each_frozen_set=False, each_casting=False, full_and_frozen_at=FEWER_SHAPES,
                              rotate_over=ROTATION))
OTHER_IMPLEMENTATIONS = [name for name in sorted(FRONTENDS) if name not in ("torch", "jax")]


_DATA: dict = {}  # repr(case) -> (inputs, reference): the last case's, for its next frontend


def _case_data(case):
    """The case's inputs and float64 reference, made once per worker and case. Each frontend runs the
    same case on the same seeded inputs, and a case's frontends are adjacent in the collection (one
    parametrization below), so with ``--dist worksteal`` (scripts/gpu-check.sh) they mostly run one
    after another on one worker: at the GPU shapes (millions of elements) the NumPy work is done once,
    not once per frontend."""
    key = repr(case)
    if key not in _DATA:
        _DATA.clear()
        inp = make_inputs(case, np.random.default_rng(zlib.crc32(str(case).encode())))
        _DATA[key] = (inp, reference(case, inp))
    inp, ref = _DATA[key]
    return {k: v.copy() for k, v in inp.items()}, ref  # a frontend gets arrays of its own


def check_case(frontend, case):
    inp, ref = _case_data(case)
    res = frontend.call(case, inp)
    check_against_reference(case, res, inp, ref)
    check_launch_flags(case, res.log)


MAIN_FRONTENDS = [n for n in ("torch", "jax") if n in FRONTENDS]  # every case
_OTHER = set(OTHER_CASES) | OTHER_QUICK


def _param(case, name):
    quick = case in QUICK if name in MAIN_FRONTENDS else case in OTHER_QUICK
    return pytest.param(case, name, id=f"{case}-{name}", marks=() if quick else pytest.mark.slow)


PARAMS = [_param(case, name)
          for case in CASES for name in MAIN_FRONTENDS + (OTHER_IMPLEMENTATIONS if case in _OTHER else [])]


@pytest.mark.parametrize("case,name", PARAMS)
def test_parity(case, name):
    check_case(FRONTENDS[name](), case)


def test_default_run_meets_every_variant_and_shape():
    """What the module docstring claims of the default run, checked on the case lists: every
    combination but the shape (Torch and JAX); every kernel flag combination in the default casting,
    and every casting mode and offset with every op and dtype (Pallas and XLA); and every shape with
    every op and dtype, trained and frozen, that the whole suite runs."""
    def kernel(c):
        return c.op, c.dtype, c.casting, c.offset, c.params, c.spec.grads(c.trained)

    def frozen_sets(c):
        return kernel(c) + (c.trained,)

    def default_casting(cases):
        return [c for c in cases if (c.casting, c.offset) == (DEFAULT_CASTING_MODE, 0.0)]

    def casting(c):
        return c.op, c.dtype, c.casting, c.offset

    for quick, every, key in ((QUICK, CASES, frozen_sets), (default_casting(OTHER_QUICK), default_casting(OTHER_CASES),
                                                             kernel), (OTHER_QUICK, OTHER_CASES, casting)):
        assert {key(c) for c in every} == {key(c) for c in quick}
        assert {(c.shape, c.op, c.dtype, c.spec.grads(c.trained)) for c in every
                if c.params == c.spec.params and c.trained in (frozenset(c.inputs), frozenset(c.spec.row_inputs))
                } <= {(c.shape, c.op, c.dtype, c.spec.grads(c.trained)) for c in quick}
