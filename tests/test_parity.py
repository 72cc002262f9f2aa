"""Parity with the float64 reference for every op, dtype, casting mode, offset, parameter set,
frozen set and shape; the launch record must show exactly the requested backward variant.

Torch and the JAX frontend's default implementation run every case; the JAX frontend's other
implementations (Pallas, XLA) run every combination on fewer shapes: D = 1, several row tiles and
programs (the dW/dB partials), and an odd D above 4096. The body is the same for all of them.
"""
import os
import zlib

import numpy as np
import pytest

from normkit.shapes import shapes
from tests.frontends import FRONTENDS
from tests.harness import check_against_reference, check_launch_flags, make_inputs, parity_cases

SIZE_TAG = os.environ.get("NORMKIT_TEST_SHAPES", "ci")  # "gpu" on the GPU machine: larger shapes too
SHAPES = shapes("ci") + (shapes("gpu") if SIZE_TAG == "gpu" else [])
CASES = parity_cases(SHAPES)
FEWER_SHAPES = [s for s in SHAPES if s.name in ("d1", "many_rows", "d4097") or s.tags == frozenset({"gpu"})]
OTHER_IMPLEMENTATIONS = [name for name in sorted(FRONTENDS) if name not in ("torch", "jax")]


def check_case(frontend, case):
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    inp = make_inputs(case, rng)
    res = frontend.call(case, inp)
    check_against_reference(case, res, inp)
    check_launch_flags(case, res.log)


@pytest.mark.parametrize("name", [n for n in ("torch", "jax") if n in FRONTENDS])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity(name, case):
    check_case(FRONTENDS[name](), case)


@pytest.mark.parametrize("name", OTHER_IMPLEMENTATIONS)
@pytest.mark.parametrize("case", parity_cases(FEWER_SHAPES), ids=str)
def test_parity_other_jax_implementations(name, case):
    check_case(FRONTENDS[name](), case)
