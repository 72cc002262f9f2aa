"""JAX distributed: jit on inputs sharded over a 2-device mesh, Auto and Explicit axes.

The cases (``tests/dist_workers.py``, ``jax_cases``) run once for the module: in this process when
it has two devices or more (``CUDA_VISIBLE_DEVICES=0,1`` on a GPU machine), else on CPU in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (the flag must be set before
JAX initializes; the rest of the suite runs with one device): ``python -m tests.dist_workers jax``.
Each is judged by ``dist_workers.jax_failures``: results against the float64 reference and the
unsharded run, outputs sharded like x, and the compiled HLO (``tests.hlo``): no collective that
moves an activation, one all-reduce of dW/dB per trained parameter, none for a frozen one.

x split along its normalized dimension on an Auto mesh (``dist_workers.jax_hidden_split``) runs in a
subprocess of its own for each partitioner, on this process's devices or on two CPU devices: under
GSPMD an exception in the sharding rule aborts the whole process, which the test must survive.

In-process tests below cover what needs no second device: one-device meshes, the HLO parser.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_frontend as jf
from tests import dist_workers
from tests.hlo import collectives
from normkit.testing import assert_close
from tests.frontends import requires_torch

ROOT = Path(__file__).resolve().parent.parent


def _worker(out: Path, group: str, env: dict) -> tuple[dict | None, str]:
    """({name: case}, "") from ``python -m tests.dist_workers jax --group GROUP`` in a subprocess, or
    (None, why) when it did not exit normally. With two devices or more here it runs on this process's
    platform, else on two host-platform CPU devices."""
    if jax.device_count() >= 2:
        env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""), **env}
    else:
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
               "CUDA_VISIBLE_DEVICES": "", **env}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    proc = subprocess.run([sys.executable, "-m", "tests.dist_workers", "jax", "--group", group, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        code = proc.returncode
        killed = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
        return None, f"exit {code}{killed}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {c["name"]: c for c in json.loads(out.read_text())}, ""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    if jax.device_count() >= 2:
        return {c["name"]: c for c in dist_workers.jax_cases(devices=jax.devices()[:2])}
    found, why = _worker(tmp_path_factory.mktemp("dist_jax") / "jax.json", "all", {})
    assert found is not None, why
    return found


@pytest.fixture(scope="module")
def hidden_split(tmp_path_factory):
    """partitioner -> ({name: case}, "") or (None, why the subprocess failed), each run once."""
    runs = {}

    def run(partitioner: str):
        if partitioner not in runs:
            out = tmp_path_factory.mktemp(f"hidden_split_{partitioner}") / "jax.json"
            runs[partitioner] = _worker(out, "hidden_split",
                                        {"JAX_USE_SHARDY_PARTITIONER": str(partitioner == "shardy").lower()})
        return runs[partitioner]

    return run


def _check(cases: dict, name: str) -> dict:
    if name not in cases:  # a group of cases that crashed before naming its cases: show why
        crashes = "\n\n".join(f"{c['name']}:\n{c['crash']}" for c in cases.values() if "crash" in c)
        pytest.fail(f"no case {name!r} was produced; crashed groups:\n{crashes or '(none)'}")
    case = cases[name]
    failures = dist_workers.jax_failures(case)
    assert not failures, "\n".join(failures)
    return case


def _names(names):
    """Case names; those of the Triton implementation need torch on CPU (Triton's interpreter), so a
    JAX-only install leaves them out."""
    return [pytest.param(n, marks=requires_torch) if "triton" in n else n for n in names]


@pytest.mark.parametrize("name", _names(c[0] for c in dist_workers.JAX_CASES))
def test_sharded_op(cases, name):
    """Every op through every implementation, Auto and Explicit axes: per-device kernels, outputs and dx
    sharded like x, results as unsharded; trained: one all-reduce per parameter; frozen (stop_gradient
    or freeze): no collective at all."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["fsdp_weight_auto", "fsdp_weight_explicit"])
def test_weight_sharded_along_n_is_gathered(cases, name):
    """A weight sharded FSDP-style: its N elements are gathered, the activation never moves."""
    _check(cases, name)


@pytest.mark.parametrize("name", _names(["vmap_auto", "vmap_explicit", "layer_norm_triton_auto_device_put_batch_gspmd"]
                                        + [f"eager_auto_{i}" for i in dist_workers.JAX_IMPLEMENTATIONS]))
def test_vmap_eager_and_gspmd(cases, name):
    """vmap over a sharded axis keeps it split; eager calls on split arrays run per device too; the rule
    also holds under the GSPMD partitioner."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["user_shard_map_trained", "user_shard_map_frozen"])
def test_inside_user_shard_map(cases, name):
    """Called inside the caller's shard_map (Auto mesh): JAX's transpose reduces dW once; frozen: never."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["replicated_auto", "replicated_pallas", "replicated_xla"])
def test_replicated_inputs_on_a_mesh(cases, name):
    """Arrays made after jax.set_mesh are replicated on the mesh: eager and jit both work, with no collective."""
    case = _check(cases, name)
    assert set(case["diff"]) == {"eager", "jit"}


@pytest.mark.parametrize("name", sorted(dist_workers.JAX_ERROR_EXPECTATIONS))
def test_sharding_errors(cases, name):
    """In the inputs' types (Explicit axes): a sharded normalized dimension, a residual sharded unlike x:
    a clear error naming the placement, before any launch."""
    _check(cases, name)


@pytest.mark.parametrize("name", [*dist_workers.JAX_HIDDEN_SPLIT, *dist_workers.JAX_HIDDEN_SPLIT_ERRORS])
@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_normalized_dimension_split_on_an_auto_mesh(hidden_split, partitioner, name):
    """x split along its normalized (last) dimension on an Auto mesh, under each partitioner. Under jit
    (committed so, or constrained so inside the function) the process survives and the op is correct:
    the partitioner gathers that dimension (outputs and every gradient against the float64 reference
    and the unsharded run), with a logged warning saying so. Eager, a committed x so placed: a
    ValueError naming its sharding, before any launch. Under GSPMD an exception from the sharding
    rule would abort the process: the subprocess must exit normally."""
    found, why = hidden_split(partitioner)
    assert found is not None, f"the {partitioner} subprocess did not exit normally: {why}"
    case = _check(found, name)
    assert case["partitioner"] == partitioner


# ---------------------------------------------------------------------------------------------
# In-process (one device).


def test_case_table_covers_every_implementation():
    assert dist_workers.JAX_IMPLEMENTATIONS == jf.IMPLEMENTATIONS
    table = {(impl, op, axis, placement) for _, impl, op, axis, placement, *_ in dist_workers.JAX_CASES}
    for axis in ("auto", "explicit"):  # every placement meets every op and every implementation
        for placement in dist_workers.JAX_PLACEMENTS:
            assert {op for _, op, a, p in table if (a, p) == (axis, placement)} == set(dist_workers.OPS)
            assert {impl for impl, _, a, p in table if (a, p) == (axis, placement)} == set(jf.IMPLEMENTATIONS)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_one_device_mesh_runs_unsharded(axis_type):
    """A mesh of one device: the same result as without a mesh (Explicit: shard_map over one device;
    Auto: the per-device rule is not even lowered)."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(axis_type,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
    grad = jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w) ** 2), argnums=(0, 1))
    ref = grad(x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P()))
        got = jax.jit(grad)(xs, ws)
    for a, b, reduced_over in zip(got, ref, (1, 8)):
        assert_close(np.asarray(a), np.asarray(b), "float32", "gradient", reduced_over)


def test_the_sharding_rule_answers_whatever_it_is_handed():
    """XLA's partitioner calls the rule while it compiles, where an exception from
    ``infer_sharding_from_operands`` aborts the process under GSPMD, so the rule answers every
    proposal: x's leading dimensions as proposed and its normalized dimension whole; an operand with
    no sharding yet as replicated; without a mesh (x placed by a ``GSPMDSharding``; a one-device
    ``SingleDeviceSharding`` stands in for it here) every buffer whole on x's devices."""
    from jax_frontend import _custom_partitioning, _xla
    from jax_frontend._rows import COLUMN, LAYOUT, ROW, STAT, Pass
    from normkit.ops import LAYER_NORM, Grads

    opts = LAYER_NORM.options(eps=LAYER_NORM.default_eps)
    grads = Grads(dx=True, dw=True, db=True)
    passes = (Pass(_xla, LAYER_NORM, opts, ("x", "weight", "bias"), store_stats=True),
              Pass(_xla, LAYER_NORM, opts, ("x", "weight", "dy", "mean", "rstd"), grads=grads, b_dtype="float32"))
    mesh = jax.make_mesh((1, 1), ("data", "sp"), axis_types=(AxisType.Auto,) * 2)
    no_mesh = jax.sharding.Mesh(np.empty((), dtype=object), ())
    assert no_mesh.empty
    proposals = [  # (mesh, x's proposed sharding, the row spec answered, the statistics' spec)
        (mesh, NamedSharding(mesh, P("data", None, "sp")), P("data", None, None), P("data", None)),
        (mesh, NamedSharding(mesh, P(None, None, ("data", "sp"))), P(None, None, None), P(None, None)),
        (mesh, None, P(None, None, None), P(None, None)),
        (no_mesh, jax.sharding.SingleDeviceSharding(jax.devices()[0]), P(), P()),
    ]
    for pass_ in passes:
        for mesh_in, proposed, row, stat in proposals:
            x = jax.ShapeDtypeStruct((2, 4, 16), jnp.float32, sharding=proposed)
            want = {ROW: row, STAT: stat, COLUMN: P()}
            inferred = _custom_partitioning._infer(pass_, mesh_in, [x], None)
            mesh_out, _, outs, ins = _custom_partitioning._partition(pass_, None, mesh_in, [x], None)
            assert not mesh_out.empty
            for name, sharding in [*zip(pass_.outputs, inferred), *zip(pass_.outputs, outs), *zip(pass_.inputs, ins)]:
                assert sharding.mesh == mesh_out and sharding.spec == want[LAYOUT[name]], (proposed, name, sharding)


def test_failures_read_the_hlo():
    """The judge reads ``tests.hlo.collectives``: dW and dB in one all-reduce (a tuple, or concatenated
    as XLA on GPU does) pass; more reduced elements, a frozen parameter's reduction, or a gathered
    activation fail; a gathered N-element weight does not."""
    trained = """
  %merged = (f32[16]{0}, f32[16]{0}) all-reduce(%dw, %db), channel_id=1, replica_groups={{0,1}}, to_apply=%add
"""
    concatenated = "  %ar = f32[32]{0} all-reduce(f32[32]{0} %dwdb), channel_id=1, to_apply=%add\n"  # XLA on GPU
    gathered_x = "  %ag = f32[8,16]{1,0} all-gather(f32[4,16]{1,0} %x), dimensions={0}\n"
    gathered_w = "  %ag = (f32[8]{0}, f32[16]{0}) all-gather-start(f32[8]{0} %w), dimensions={0}\n"
    row = {"ok": True, "message": "", "layout": "row", "spec": "('data',)", "placed_as_expected": True,
           "unsharded_diff": 0.0, "unsharded": {"ok": True}}
    case = {"kind": "sharded", "name": "c", "implementation": "xla", "spec": "('data',)", "params": ["weight", "bias"],
            "N": 16, "results": {"y": row}, "frozen_param_grads_max": [0.0, 0.0],
            "collectives": {"trained": collectives(trained, (16,)), "frozen": collectives("", (16,))}}
    assert dist_workers.jax_failures(case) == []
    case["collectives"]["trained"] = collectives(concatenated, (16,))
    assert dist_workers.jax_failures(case) == []
    case["collectives"]["trained"] = collectives(trained + concatenated, (16,))
    assert "expected one all-reduce" in dist_workers.jax_failures(case)[0]
    case["collectives"] = {"trained": collectives(trained, (16,)), "frozen": collectives(trained, (16,))}
    assert "parameters frozen" in dist_workers.jax_failures(case)[0]
    case["collectives"] = {"trained": collectives(trained + gathered_x, (16,)), "frozen": collectives("", (16,))}
    assert "expected one all-reduce" in dist_workers.jax_failures(case)[0]
    fsdp = {"kind": "fsdp", "name": "f", "N": 16, "axis_type": "auto", "collectives": collectives(gathered_w, (16,))}
    assert collectives(gathered_w)["all_gather_arrays"] == ["f32[16]"]
    assert dist_workers.jax_failures(fsdp) == []
    fsdp["collectives"] = collectives(gathered_w + gathered_x, (16,))
    assert "no activation moved" in dist_workers.jax_failures(fsdp)[0]


def test_hlo_counts_each_async_all_reduce_once_by_what_it_reduces():
    hlo = """
  %sync = f32[16]{0} all-reduce(f32[16]{0} %a), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %merged = (f32[16]{0}, bf16[16]{0}) all-reduce(%b, %c), channel_id=2, to_apply=%add
  %s = (f32[16]{0}, f32[16]{0}) all-reduce-start(f32[16]{0} %d), channel_id=3, to_apply=%add
  %s2 = ((f32[4]{0}, f32[8]{0}), (f32[4]{0}, f32[8]{0})) all-reduce-start(%e, %f), to_apply=%add
  %s3 = (f32[16]{0}, f32[16]{0}) all-reduce-start(%g, %h), to_apply=%add
  %d = (f32[16]{0}, f32[16]{0}) all-reduce-done(%s3)
  %d2 = f32[16]{0} all-reduce-done(%s)
  %ag = f32[32]{0} all-gather-start(f32[16]{0} %i), dimensions={0}
  ROOT %agd = f32[32]{0} all-gather-done(%ag)
"""
    got = collectives(hlo, (16,))
    # async starts typed (operands, results) count their operands once; the -done lines not at all
    assert got["all_reduce_ops"] == 5 and got["all_gather"] == 1, got
    assert got["all_reduce_elements"] == [16, 32, 16, 12, 32], got
    assert got["all_reduce_arrays"] == ["f32[16]", "f32[16]", "bf16[16]", "f32[16]", "f32[4]", "f32[8]",
                                        "f32[16]", "f32[16]"]
    assert got["all_reduce_bytes"] == 4 * 16 + (4 * 16 + 2 * 16) + 4 * 16 + 4 * 12 + 4 * 32
    assert got["param_reductions"] == 6 and len(got["all_reduce_lines"]) == 5
    assert got["all_reduce_lines"][1].startswith("%merged = (f32[16]{0}, bf16[16]{0}) all-reduce(")
    none = collectives("%x = f32[16]{0} add(%a, %b)")
    assert none["all_reduce_ops"] == 0 and none["all_reduce_bytes"] == 0 and "param_reductions" not in none
