"""Parity with the float64 reference for every op, dtype, casting mode, offset, parameter set,
frozen set and shape; the launch record must show exactly the requested backward variant."""
import os
import zlib

import numpy as np
import pytest

from normkit.shapes import shapes
from tests.harness import check_against_reference, check_launch_flags, make_inputs, parity_cases

SIZE_TAG = os.environ.get("NORMKIT_TEST_SHAPES", "ci")  # "gpu" on the GPU machine: larger shapes too
CASES = parity_cases(shapes("ci") + (shapes("gpu") if SIZE_TAG == "gpu" else []))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity(frontend, case):
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    inp = make_inputs(case, rng)
    res = frontend.call(case, inp)
    check_against_reference(case, res, inp)
    check_launch_flags(case, res.log)
