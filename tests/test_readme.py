"""The README's Python examples run as written, each in a fresh interpreter on the CPU, and print what
their comments say. A block whose first line names ``torchrun`` runs on 2 gloo ranks (slow tier); one
that names ``XLA_FLAGS=...`` runs with that variable set. A block needing a framework that is not
installed is skipped (a JAX-only install runs the JAX examples)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
# What each example must print (a regular expression over its output), by a line of its code.
EXPECTED = {
    "print(tf.patch_model(model))": r"LayerNorm",
    'print(backward.flags["COMPUTE_DW"], backward.partial_buffers)': r"^False \(\)$",
    'print(jf.resolve_implementation(), float(jnp.abs(grads["norm"]).max()))': r"^(triton|pallas) 0\.0$",
    "print(y.placements, x.grad.placements, norm.weight.grad)": r"Shard\(dim=1\).*Shard\(dim=1\).*None",
    'print(trainable, "all-reduce:"': r"True all-reduce: [1-9].*\nFalse all-reduce: 0 all-gather: 0",
    "print(tf.save_decision(w, dtype=torch.bfloat16).reason)": r"saves_output=True.*\n^column 3: the weight is 0\b",
}


def _id(block: str) -> str:
    return re.sub(r"\W+", "_", next(line for line in block.splitlines() if "import" in line))[:40]


def _run(block: str, tmp_path: Path) -> str:
    for module in ("torch", "jax"):
        if re.search(rf"^\s*import {module}\b|^from {module}\b|import \w+ as \w+, {module}\b|^import {module},",
                     block, re.M):
            pytest.importorskip(module)
    first = block.splitlines()[0]
    script = tmp_path / "example.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(script)]
    if "torchrun" in first:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    if (flags := re.search(r"XLA_FLAGS=(\S+)", first)) is not None:
        env.update(XLA_FLAGS=flags[1], JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{first}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.slow] * ("torchrun" in b.splitlines()[0]),
                                                id=_id(b)) for b in BLOCKS])
def test_readme_example_runs(block, tmp_path):
    out = _run(block, tmp_path)
    checks = [pattern for line, pattern in EXPECTED.items() if line in block]
    assert checks, "an example without an expected output: add it to EXPECTED"
    for pattern in checks:
        assert re.search(pattern, out, re.M), f"expected /{pattern}/ in the output:\n{out}"


def test_every_example_is_found():
    assert len(BLOCKS) == 6 and all(any(line in b for b in BLOCKS) for line in EXPECTED)
