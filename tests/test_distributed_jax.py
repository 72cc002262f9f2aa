"""JAX distributed: jit on inputs sharded over a 2-device mesh, on CPU.

The cases run once for the module in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
(the flag must be set before JAX initializes; the rest of the suite runs with one device):
``python -m benchmarks.dist_workers jax``. Each is judged by ``dist_workers.jax_failures``: results
against the unsharded run, and the compiled HLO: no all-gather (nor all-to-all / collective-permute)
of the activations, and in the backward exactly one all-reduced array of the parameter's shape per
trained norm parameter, none for a frozen one.

In-process tests below cover what needs no second device: the sharding helpers on one-device meshes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_frontend as jf
from benchmarks import dist_workers
from benchmarks.hlo import collectives
from jax_frontend import _sharding
from normkit.ops import RMS_NORM

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist_jax") / "jax.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.dist_workers", "jax", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {c["name"]: c for c in json.loads(out.read_text())}


def _check(cases: dict, name: str) -> dict:
    case = cases[name]
    failures = dist_workers.jax_failures(case)
    assert not failures, "\n".join(failures)
    return case


@pytest.mark.parametrize("name", [c[0] for c in dist_workers.JAX_CASES])
def test_sharded_op(cases, name):
    """Per-device kernels through shard_map: equal to the unsharded run, outputs sharded like x, no
    all-gather; one all-reduce per trained parameter, over the row axes only."""
    _check(cases, name)


def test_frozen_drops_the_all_reduce(cases):
    trained, frozen = _check(cases, "ln_batch_trained"), _check(cases, "ln_batch_frozen")
    assert trained["backward_hlo"]["all_reduce_arrays"] == ["f32[16]", "f32[16]"]  # dW, dB
    assert _check(cases, "ln_batch_bias_frozen")["backward_hlo"]["all_reduce_arrays"] == ["f32[16]"]
    assert frozen["backward_hlo"]["all_reduce_ops"] == 0
    for case in (trained, frozen):  # row-wise results are computed on each device's rows: identical
        assert case["errors"]["y"]["max_abs"] == 0.0 and case["errors"]["dx"]["max_abs"] == 0.0, case["errors"]


@pytest.mark.parametrize("name", ["user_shard_map_trained", "user_shard_map_frozen"])
def test_inside_user_shard_map(cases, name):
    """Called inside the caller's shard_map (Auto mesh): JAX's transpose reduces dW once; frozen: never."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["replicated_auto", "replicated_pallas", "replicated_xla"])
def test_replicated_inputs_on_a_mesh(cases, name):
    """Arrays made after jax.set_mesh are replicated on the mesh: eager and jit both work, with no collective."""
    case = _check(cases, name)
    assert set(case["diff"]) == {"eager", "jit"}


def test_auto_mesh_warns_and_stays_correct(cases):
    _check(cases, "auto_mesh_unsharded_fallback")


@pytest.mark.parametrize("name", sorted(dist_workers.JAX_ERROR_EXPECTATIONS))
def test_sharding_errors(cases, name):
    """A sharded normalized dimension, a sharded weight, a residual sharded unlike x: a clear error at
    trace time, before any launch."""
    _check(cases, name)


# ---------------------------------------------------------------------------------------------
# In-process (one device).


def test_unsharded_inputs_take_the_plain_path():
    x = jnp.ones((2, 3, 8), jnp.float32)
    assert _sharding.sharded_impl(RMS_NORM, object(), x) is None
    assert _sharding.match_varying(x, None) == (x, None)


def test_hlo_collectives_parser():
    hlo = """
  %all-reduce = f32[16]{0} all-reduce(f32[16]{0} %a), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ar2 = (f32[16]{0}, bf16[16]{0}) all-reduce(f32[16]{0} %b, bf16[16]{0} %c), channel_id=2, to_apply=%add
  %ars = f32[] all-reduce-start(f32[] %d), channel_id=3, to_apply=%add
  %ag = f32[4,16]{1,0} all-gather(f32[2,16]{1,0} %e), dimensions={0}
"""
    got = collectives(hlo, (16,))
    assert got["all_reduce_ops"] == 3 and got["param_reductions"] == 3 and got["all_gather"] == 1, got
    assert got["all_reduce_arrays"] == ["f32[16]", "f32[16]", "bf16[16]", "f32[]"]
    assert got["all_reduce_elements"] == [16, 32, 1] and len(got["all_reduce_lines"]) == 3


def test_hlo_collectives_merged_and_async():
    """What XLA on GPU emits: dW and dB merged into one buffer; an async start typed (operands, results)."""
    hlo = """
  %merged = f32[32]{0} all-reduce(f32[32]{0} %cat), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %s = (f32[16]{0}, f32[16]{0}) all-reduce-start(f32[16]{0} %a), channel_id=2, to_apply=%add
  %s2 = (f32[16]{0}, f32[8]{0}) all-reduce-start(f32[16]{0} %a, f32[8]{0} %b), channel_id=3, to_apply=%add
  %s3 = ((f32[4]{0}, f32[4]{0}), (f32[4]{0}, f32[4]{0})) all-reduce-start(f32[4]{0} %a, f32[4]{0} %b), to_apply=%add
"""
    got = collectives(hlo, (16,))
    assert got["all_reduce_elements"] == [32, 16, 24, 8], got
    case = {"name": "c", "kind": "sharded", "params": ["weight", "bias"], "trained": ["x", "weight", "bias"],
            "spec": ["data", None], "errors": {}, "N": 16, "forward_hlo": collectives("", (16,)),
            "backward_hlo": collectives(hlo.split("\n")[1], (16,))}
    assert dist_workers.jax_failures(case) == []  # one merged all-reduce of dW and dB: right
    case["backward_hlo"] = collectives(hlo, (16,))  # 80 elements for 2 x 16: wrong
    assert dist_workers.jax_failures(case) and "reduced once" in dist_workers.jax_failures(case)[0]
    case["trained"] = ["x"]
    case["backward_hlo"] = collectives("", (16,))
    assert dist_workers.jax_failures(case) == []  # frozen: nothing reduced


def test_one_device_mesh_runs_unsharded():
    """A mesh of one device (shard_map over it, psum over one device): the same result as without a mesh."""
    mesh = jax.make_mesh((1,), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
    ref = jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w) ** 2), argnums=(0, 1))(x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.PartitionSpec("data"))
        ws = jax.device_put(w, jax.sharding.PartitionSpec())
        got = jax.jit(jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w) ** 2), argnums=(0, 1)))(xs, ws)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
