"""Torch distributed: DTensor sequence/batch parallel, DDP and FSDP2 on CPU.

Two gloo ranks on 127.0.0.1, spawned once for the module by a subprocess (``python -m
tests.dist_workers torch``, with a timeout); kernels in Triton's interpreter. Each case runs on both
ranks and is judged on both (``dist_workers.torch_failures``): results against the single-process
run, and the collectives ``CommDebugMode`` counts in the forward, the backward, and while reducing
the parameter gradients (one all-reduce per trained weight or bias, none for a frozen one).

Also here: the two-GPU script's ``--dry-run`` (``scripts/multi_gpu.py``, both frontends on CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import dist_workers

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(argv: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist_torch") / "torch.json"
    _run(["-m", "tests.dist_workers", "torch", "--out", str(out)])
    return {c["name"]: c for c in json.loads(out.read_text())}


def _check(cases: dict, name: str) -> dict:
    case = cases[name]
    failures = dist_workers.torch_failures(case) + case.get("other_ranks_failures", [])
    assert not failures, "\n".join(failures)
    return case


@pytest.mark.parametrize("name", [c[0] for c in dist_workers.TORCH_CASES])
def test_dtensor_op(cases, name):
    """Sharded like x, equal to one process; collectives only to reduce trained parameters' gradients."""
    _check(cases, name)


def test_sequence_parallel_gradient_placements(cases):
    """The contract spelled out: y keeps Shard(1); a trained weight's gradient is Partial(sum) with no
    collective in the backward, and reducing it is one all-reduce; a frozen weight has no gradient."""
    trained, frozen = _check(cases, "rms_sp_trained"), _check(cases, "rms_sp_frozen")
    assert trained["errors"]["y"]["placements"] == "(Shard(dim=1),)"
    assert trained["grad_placements"]["weight"] == "(Partial(sum),)"
    assert trained["comms"] == {"forward": {}, "backward": {}, "reduce": {"all_reduce": 1}}
    assert frozen["grad_placements"]["weight"] is None
    assert frozen["comms"] == {"forward": {}, "backward": {}, "reduce": {}}
    ln = _check(cases, "ln_sp_trained")
    assert ln["comms"]["reduce"] == {"all_reduce": 2}  # weight and bias
    # y and dx are computed row by row on each rank's rows: identical to one process.
    for case in (trained, frozen, ln):
        assert case["errors"]["y"]["max_abs"] == 0.0 and case["errors"]["dx"]["max_abs"] == 0.0, case["errors"]


@pytest.mark.parametrize("name", sorted(dist_workers.ERROR_EXPECTATIONS))
def test_placement_errors(cases, name):
    """A sharded normalized dimension, a partial x, a sharded weight, a plain weight with a DTensor x:
    a clear error naming the placement, before any kernel launch."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["sequence_parallel_module_trained", "sequence_parallel_module_frozen"])
def test_sequence_parallel_module(cases, name):
    """parallelize_module(RMSNorm, SequenceParallel()) and an SGD step: one all-reduce if trained, none if frozen."""
    _check(cases, name)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_data_parallel(cases, name):
    """DDP and FSDP2 (fully_shard) with frozen norm parameters: gradients equal to one process."""
    case = _check(cases, name)
    if name == "fsdp2":  # the frozen-only RMSNorm unit has nothing to reduce-scatter: 3 trained units, 3 calls
        assert case["comms"]["_reduce_scatter_base_"]["count"] == 3, case["comms"]


def test_fsdp2_over_peft_default_adapters(cases):
    """FSDP2 over a bf16 Llama with PEFT's fp32 adapters, patched: q/k/v share their norm's fp32 copy
    under the sharded step, and the LoRA gradients are one process's."""
    _check(cases, "peft_fsdp2")


def test_registration_is_lazy():
    """Plain tensors never import torch.distributed.tensor nor register anything."""
    proc = _run(["-c", "import sys, torch, torch_frontend as tf\n"
                       "x = torch.randn(2, 3, 8, requires_grad=True)\n"
                       "tf.rms_norm(x, torch.ones(8)).sum().backward()\n"
                       "print('torch.distributed.tensor' in sys.modules, 'torch_frontend._dtensor' in sys.modules)"])
    assert proc.stdout.split() == ["False", "False"], proc.stdout


@pytest.mark.slow  # a script's smoke test: the distributed behaviour is tested above and in test_distributed_jax.py
def test_multi_gpu_dry_run(tmp_path):
    """scripts/multi_gpu.py --dry-run: both parts on CPU, tiny; every case passes and the benchmark's
    collectives show what freezing the norms saves."""
    out = tmp_path / "dry.json"
    proc = _run(["scripts/multi_gpu.py", "--dry-run", "--out", str(out)], timeout=900)
    result = json.loads(out.read_text())
    for part in ("torch", "jax"):
        assert result[part]["cases"] and not result[part]["failures"], (part, result[part]["failures"], proc.stdout)
    bench = {b["variant"]: b for b in result["torch"]["bench"]}
    assert set(bench) == {f"{i}_norms_{s}" for i in ("normkit", "hf") for s in ("frozen", "trained")}, bench
    n_norms = 2 * 2 + 1  # the dry-run Llama: 2 layers of 2 norms, and the final norm
    for impl in ("normkit", "hf"):
        frozen, trained = bench[f"{impl}_norms_frozen"], bench[f"{impl}_norms_trained"]
        extra = (trained["collectives"]["reduce_grads"]["all_reduce"]["count"]
                 - frozen["collectives"]["reduce_grads"]["all_reduce"]["count"])
        assert extra == n_norms, (impl, frozen["collectives"], trained["collectives"])
        # Trained norms also need the gradient of the first layer's norm output: the backward of the first
        # attention input's all-gather, one more (activation-sized) reduce-scatter. Frozen, it never runs.
        rs = [b["collectives"]["backward"]["reduce_scatter_tensor"]["count"] for b in (frozen, trained)]
        assert rs[1] == rs[0] + 1, (impl, frozen["collectives"], trained["collectives"])
        assert not trained["collectives"]["optimizer"], trained["collectives"]  # reduced once, before the step
    assert abs(bench["normkit_norms_frozen"]["loss"] - bench["hf_norms_frozen"]["loss"]) < 1e-4
    for b in result["jax"]["bench"]:
        c = b["fwd_bwd_collectives"]
        assert c["all_gather"] == 0 and c["all_reduce_ops"] == int(b["weight_trained"]), b
