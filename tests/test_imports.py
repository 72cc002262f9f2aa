"""What an install without the triton package can do: the JAX frontend's Pallas and XLA
implementations need no triton (``pip install ".[jax]"`` installs none), so importing ``normkit``,
``normkit.launch`` or ``jax_frontend`` and running them must not import it. Each check runs in a fresh
interpreter in which ``import triton`` fails as it does where triton is not installed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_TRITON = "import sys; sys.modules['triton'] = None  # import triton: ModuleNotFoundError, find_spec: None\n"


def run_without_triton(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", NO_TRITON + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_normkit_imports_without_triton():
    out = run_without_triton(
        "import normkit, normkit.launch, normkit.driver, normkit.kernels\n"
        "from normkit.ops import OPS\n"
        "blocks = normkit.launch.pallas_blocks(OPS['layer_norm'], 64, 4096, elem_bytes=2, num_sms=4)\n"
        "print(blocks.block_n, sorted(m for m, mod in sys.modules.items() if mod and m.split('.')[0] == 'triton'))\n")
    assert out.split() == ["4096", "[]"], out


def test_the_pallas_implementation_runs_without_triton():
    pytest.importorskip("jax")
    out = run_without_triton(
        "import numpy as np, jax, jax.numpy as jnp\n"
        "import jax_frontend as jf, normkit\n"
        "from normkit.ops import OPS\n"
        "from normkit.reference import rms_norm_bwd\n"
        "from normkit.testing import assert_close, random_inputs\n"
        "inp = random_inputs(OPS['rms_norm'], (6, 40), 'float32', np.random.default_rng(0))\n"
        "x, w, dy = (jnp.asarray(inp[k], jnp.float32) for k in ('x', 'weight', 'dy'))\n"
        "print(jf.resolve_implementation())\n"  # auto skips the Triton implementation: no triton
        "with normkit.record_launches() as log:\n"
        "    y, vjp = jax.vjp(lambda x: jf.rms_norm(x, w, eps=1e-6), x)\n"
        "    (dx,) = vjp(dy)\n"
        "ref, _ = rms_norm_bwd(inp['x'], inp['weight'], inp['dy'], 1e-6)\n"
        "assert_close(np.asarray(dx, np.float64), ref, 'float32', 'dx')\n"
        "print(sorted({launch.implementation for launch in log}),"
        " sorted(m for m, mod in sys.modules.items() if mod and m.split('.')[0] == 'triton'))\n")
    assert out.split("\n")[:2] == ["pallas", "['pallas'] []"], out
