"""What an install without the triton package can do: the JAX frontend's Pallas and XLA
implementations (of the norms and of ``rms_norm_rope``) need no triton (``pip install ".[jax]"``
installs none), so importing ``normkit``, ``normkit.launch`` or ``jax_frontend`` and running them
must not import it. Each check runs in a fresh interpreter in which ``import triton`` fails as it
does where triton is not installed."""
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
        "from normkit.reference import rms_norm_bwd, rms_norm_rope_bwd\n"
        "from normkit.testing import assert_close, random_inputs\n"
        "inp = random_inputs(OPS['rms_norm'], (6, 40), 'float32', np.random.default_rng(0))\n"
        "x, w, dy = (jnp.asarray(inp[k], jnp.float32) for k in ('x', 'weight', 'dy'))\n"
        "print(jf.resolve_implementation())\n"  # auto skips the Triton implementation: no triton
        "theta = np.random.default_rng(1).uniform(-4, 4, (6, 20))\n"
        "cos, sin = (np.concatenate([f(theta)] * 2, -1).astype(np.float32) for f in (np.cos, np.sin))\n"
        "with normkit.record_launches() as log:\n"
        "    y, vjp = jax.vjp(lambda x: jf.rms_norm(x, w, eps=1e-6), x)\n"
        "    (dx,) = vjp(dy)\n"
        "    y2, vjp2 = jax.vjp(lambda x: jf.rms_norm_rope(x, w, jnp.asarray(cos), jnp.asarray(sin), eps=1e-6), x)\n"
        "    (dx2,) = vjp2(dy)\n"
        "ref, _ = rms_norm_bwd(inp['x'], inp['weight'], inp['dy'], 1e-6)\n"
        "assert_close(np.asarray(dx, np.float64), ref, 'float32', 'dx')\n"
        "ref2, _ = rms_norm_rope_bwd(inp['x'], inp['weight'], cos.astype(np.float64), sin.astype(np.float64), "
        "inp['dy'], 1e-6)\n"
        "assert_close(np.asarray(dx2, np.float64), ref2, 'float32', 'rms_norm_rope dx')\n"
        "print(sorted({launch.implementation for launch in log}),"
        " sorted(m for m, mod in sys.modules.items() if mod and m.split('.')[0] == 'triton'))\n")
    assert out.split("\n")[:2] == ["pallas", "['pallas'] []"], out
