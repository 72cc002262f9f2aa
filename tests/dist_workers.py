"""The distributed cases, run by the tests (CPU) and by ``scripts/multi_gpu.py`` (compiled, on GPUs).

Torch (``torch_cases``): on every rank of an initialized process group of 2 ranks, each op on
DTensors (sequence parallel ``Shard(1)``, batch ``Shard(0)``, uneven shards, replicated rows) with
trainable and frozen parameters, against the single-process result on the same device, counting
collectives with ``CommDebugMode`` per phase (forward, backward, reducing the gradients); the
placement errors; a ``SequenceParallel`` module; DDP and FSDP2 on a small model with frozen norms.

JAX (``jax_cases``): in one process with 2 devices, every op through every implementation under
``jit`` on inputs sharded over a mesh of Auto axes and one of Explicit axes, placed three ways,
trained and with frozen parameters; against the float64 reference and the unsharded run, reading
the compiled HLO's collectives (``tests.hlo``). Also a weight sharded FSDP-style, vmap, eager
calls, the GSPMD partitioner, the caller's own shard_map, replicated inputs and the placement errors.
``jax_hidden_split``: x split along its normalized dimension on an Auto mesh, under whichever
partitioner the process runs; a group of its own, which the tests run in a subprocess per partitioner.

Every case is a JSON-able dict; ``torch_failures`` / ``jax_failures`` list what is wrong with one
(empty when it passes), so that the tests and the GPU script judge results the same way.

Command line (each in its own process; the tests run these with a timeout)::

    python -m tests.dist_workers torch --out results.json     # spawns 2 gloo ranks on CPU
    python -m tests.dist_workers jax --out results.json       # 2 host-platform CPU devices
    JAX_USE_SHARDY_PARTITIONER=false python -m tests.dist_workers jax --group hidden_split --out results.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import tempfile
import traceback
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.hlo import collectives  # noqa: E402
from normkit.ops import OPS  # noqa: E402
from normkit.testing import assert_close  # noqa: E402

TINY = (2, 4, 16)  # B, S, D: the CPU tests' shape (D differs from B and S, so HLO shapes identify params)
COLLECTIVE_NAMES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all",
                    "alltoall", "broadcast", "reduce_", "gather_", "scatter_")


def _err(actual, ref, dtype: str, what: str, reduced_over: int = 1) -> dict:
    """{max_abs, ok, message} of ``actual`` against ``ref`` within the tolerance table."""
    actual, ref = (np.asarray(a.detach().cpu().double() if hasattr(a, "detach") else a, np.float64)
                   for a in (actual, ref))
    out = {"max_abs": float(np.abs(actual - ref).max()) if actual.size and actual.shape == ref.shape else None}
    try:
        assert_close(actual, ref, dtype, what, reduced_over)
        out.update(ok=True, message="")
    except AssertionError as e:
        out.update(ok=False, message=str(e)[:500])
    return out


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


# =============================================================================================
# Torch.


def _short(packet) -> str:
    """``c10d_functional::all_reduce`` -> ``all_reduce``."""
    name = getattr(packet, "_qualified_op_name", None) or str(packet)
    return name.split("::")[-1].split(".")[-1]


def comm_counts(mode) -> dict:
    """A CommDebugMode's counts as {short op name: count}."""
    return {_short(k): int(v) for k, v in mode.get_comm_counts().items() if v}


def comm_counter():
    """A ``CommDebugMode`` that also records (op, bytes of its input) per collective."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    class CommCounter(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out
            qual = getattr(func._overloadpacket, "_qualified_op_name", "")
            ns, _, name = qual.partition("::")
            if ns in ("c10d", "c10d_functional", "_c10d_functional", "_c10d_functional_autograd") and any(
                    c in name for c in COLLECTIVE_NAMES) and "wait" not in name:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if not tensors:  # c10d ops take lists of tensors
                    tensors = [t for a in args if isinstance(a, (list, tuple)) for t in a
                               if isinstance(t, torch.Tensor)][:1]
                self.records.append((name, int(tensors[0].numel() * tensors[0].element_size()) if tensors else 0))
            return out

        def summary(self) -> dict:
            out: dict = {}
            for name, nbytes in self.records:
                entry = out.setdefault(name, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += nbytes
            return out

    return CommCounter()


def _torch_inputs(op_name: str, shape, dtype, device, seed: int) -> dict:
    import torch

    from normkit.testing import random_inputs

    arrays = random_inputs(OPS[op_name], tuple(shape), "float32", np.random.default_rng(seed))
    return {k: torch.tensor(v, dtype=dtype if v.ndim == len(shape) else torch.float32, device=device)
            for k, v in arrays.items()}


def _call_torch(op_name: str, inputs: dict):
    import torch_frontend as tf

    op = OPS[op_name]
    out = getattr(tf, op_name)(*(inputs.get(n) for n in op.inputs))
    return list(out) if op.has_residual else [out]


def _placement(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if spec == "R" else Shard(int(spec[1:]))


def torch_case(mesh, name: str, op_name: str, placement: str, shape, trained: tuple, device: str,
               dtype_name: str = "float32") -> dict:
    """One op on DTensors of ``placement`` ("S1", "S0", "R") against the single-process result."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import normkit

    op = OPS[op_name]
    dtype = getattr(torch, dtype_name)
    data = _torch_inputs(op_name, shape, dtype, device, _seed(name))
    if name in UNSAFE_CASES:  # a bias larger than OUTPUT_BIAS_RATIO x its weight in one column: the input is kept
        data["bias"][3] = 5.0 * data["weight"][3].abs() + 1.0
    cots = [data["dy"]] + ([data["ds"]] if op.has_residual else [])
    req = {n: n in trained for n in op.inputs}

    ref_in = {n: data[n].clone().requires_grad_(req[n]) for n in op.inputs}
    ref_out = _call_torch(op_name, ref_in)
    torch.autograd.backward(ref_out, cots)

    pl = _placement(placement)
    dist_in = {n: distribute_tensor(data[n], mesh, [pl if n in op.row_inputs else Replicate()]).requires_grad_(req[n])
               for n in op.inputs}
    dist_cots = [distribute_tensor(c, mesh, [pl]) for c in cots]
    with CommDebugMode() as fwd:
        out = _call_torch(op_name, dist_in)
    with CommDebugMode() as bwd, normkit.record_launches() as log:
        torch.autograd.backward(out, dist_cots)
    # what each backward read: the output (FROM_Y, every parameter frozen) or the input
    from_output = [bool(launch.flags.get("FROM_Y")) for launch in log if "bwd" in launch.kernel]
    grad_placements = {n: (str(tuple(dist_in[n].grad.placements)) if dist_in[n].grad is not None else None)
                       for n in op.inputs}
    with CommDebugMode() as red:  # what reducing the parameter gradients costs (Partial -> Replicate)
        param_grads = {n: dist_in[n].grad.full_tensor() for n in op.params if dist_in[n].grad is not None}
    tol = dtype_name
    M = int(np.prod(shape[:-1]))
    errs = {}
    for o_name, o, r in zip(op.outputs, out, ref_out):
        errs[o_name] = _err(o.full_tensor().float().cpu(), r.detach().float().cpu(), tol, o_name)
        errs[o_name]["placements"] = str(tuple(o.placements))
    for n in op.inputs:
        g, rg = dist_in[n].grad, ref_in[n].grad
        if (g is None) != (rg is None):
            errs["d" + n] = {"ok": False, "message": f"gradient presence differs: {g is not None} vs {rg is not None}"}
        elif g is not None:
            full = param_grads[n] if n in param_grads else g.full_tensor()
            errs["d" + n] = _err(full.float().cpu(), rg.float().cpu(), tol, "d" + n,
                                 reduced_over=M if n in op.params else 1)
    return {"kind": "dtensor", "name": name, "op": op_name, "placement": placement, "shape": list(shape),
            "trained": list(trained), "params": list(op.params), "errors": errs,
            "grad_placements": grad_placements, "backward_from_output": from_output,
            "comms": {"forward": comm_counts(fwd), "backward": comm_counts(bwd), "reduce": comm_counts(red)}}


# Frozen cases whose weight and bias cannot give x_hat back from y: the backward keeps the input (the
# safety check reads the DTensor parameters' local values).
UNSAFE_CASES = ("ln_sp_frozen_unsafe_bias",)

TORCH_CASES = [
    # name, op, placement, shape (None: the default), trained inputs
    ("rms_sp_trained", "rms_norm", "S1", None, ("x", "weight")),
    ("rms_sp_frozen", "rms_norm", "S1", None, ("x",)),
    ("rms_sp_x_frozen", "rms_norm", "S1", None, ("weight",)),
    ("rms_batch_trained", "rms_norm", "S0", None, ("x", "weight")),
    ("rms_uneven_trained", "rms_norm", "S1", "uneven", ("x", "weight")),
    ("rms_replicated_trained", "rms_norm", "R", None, ("x", "weight")),
    ("ln_sp_trained", "layer_norm", "S1", None, ("x", "weight", "bias")),
    ("ln_sp_bias_frozen", "layer_norm", "S1", None, ("x", "weight")),
    ("ln_sp_frozen", "layer_norm", "S1", None, ("x",)),
    ("ln_sp_frozen_unsafe_bias", "layer_norm", "S1", None, ("x",)),
    ("ln_rows_trained", "layer_norm", "S0", "2d", ("x", "weight", "bias")),
    ("fused_sp_trained", "fused_add_rms_norm", "S1", None, ("x", "residual", "weight")),
    ("fused_sp_frozen", "fused_add_rms_norm", "S1", None, ("x", "residual")),
]


def _case_shape(kind, shape):
    B, S, D = shape
    if kind == "uneven":
        return (B, S + 1, D)  # S + 1 rows over 2 ranks: shards of different lengths
    if kind == "2d":
        return (B * S, D)
    return (B, S, D)


def torch_error_cases(mesh, device: str, shape=TINY) -> list[dict]:
    """Placements normkit refuses: the error, and that nothing was launched."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import normkit
    import torch_frontend as tf

    D = shape[-1]
    x = torch.randn(shape, device=device)
    w = torch.ones(D, device=device)
    xs = distribute_tensor(x, mesh, [Shard(1)])
    wr = distribute_tensor(w, mesh, [Replicate()])
    cases = {
        "x_sharded_on_normalized_dim": lambda: tf.rms_norm(distribute_tensor(x, mesh, [Shard(len(shape) - 1)]), wr),
        "x_partial": lambda: tf.rms_norm(DTensor.from_local(x, mesh, [Partial()], run_check=False), wr),
        "weight_sharded": lambda: tf.layer_norm(xs, distribute_tensor(w, mesh, [Shard(0)]), wr),
        "weight_plain_tensor": lambda: tf.rms_norm(xs, w),
        "residual_sharded_on_normalized_dim": lambda: tf.fused_add_rms_norm(
            xs, distribute_tensor(x, mesh, [Shard(len(shape) - 1)]), wr),
    }
    out = []
    for name, fn in cases.items():
        with normkit.record_launches() as log:
            try:
                fn()
                err = None
            except Exception as e:  # noqa: BLE001  (recorded and judged by torch_failures)
                err = f"{type(e).__name__}: {e}"
        out.append({"kind": "error", "name": name, "error": err, "launches": len(log)})
    return out


def torch_sequence_parallel_module(mesh, device: str, shape=TINY) -> list[dict]:
    """``parallelize_module(tf.RMSNorm, SequenceParallel())`` and an SGD step: the step's collectives."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import torch_frontend as tf

    rank, world = mesh.get_local_rank(), mesh.size()
    B, S, D = shape
    out = []
    for trained in (True, False):
        torch.manual_seed(0)
        x = torch.randn(shape, device=device)
        norm = tf.RMSNorm(D, device=device)
        ref = tf.RMSNorm(D, device=device)
        ref.weight.requires_grad_(trained)
        parallelize_module(norm, mesh, SequenceParallel())
        # SequenceParallel re-creates the parameters as nn.Parameter(DTensor), which sets requires_grad=True:
        # freeze *after* parallelizing.
        norm.weight.requires_grad_(trained)
        opt = torch.optim.SGD([p for p in norm.parameters() if p.requires_grad] or [torch.zeros(1, requires_grad=True)],
                              lr=0.1)
        chunk = S // world
        local = x[:, rank * chunk:(rank + 1) * chunk].clone().requires_grad_()
        y = norm(local)
        with CommDebugMode() as bwd:
            (y.to_local() ** 2).sum().backward()
        with CommDebugMode() as step:
            opt.step()
        ref_x = x.clone().requires_grad_()
        (ref(ref_x) ** 2).sum().backward()
        record = {"kind": "sp_module", "name": f"sequence_parallel_module_{'trained' if trained else 'frozen'}",
                  "trained": trained, "output_placements": str(tuple(y.placements)),
                  "comms": {"backward": comm_counts(bwd), "step": comm_counts(step)},
                  "errors": {"dx": _err(local.grad.cpu(), ref_x.grad[:, rank * chunk:(rank + 1) * chunk].cpu(),
                                        "float32", "dx")}}
        if trained:
            with torch.no_grad():
                expected = ref.weight - 0.1 * ref.weight.grad
            record["errors"]["updated_weight"] = _err(norm.weight.full_tensor().detach().cpu(), expected.cpu(),
                                                      "float32", "weight after the step", reduced_over=B * S)
        out.append(record)
    return out


def _small_model(device, D: int):
    import torch

    import torch_frontend as tf

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(D, D), tf.RMSNorm(D), torch.nn.Linear(D, D), tf.LayerNorm(D)).to(device)
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[3].weight.uniform_(0.5, 1.5)
        m[3].bias.uniform_(-0.5, 0.5)
    m[1].weight.requires_grad_(False)  # a frozen RMSNorm weight
    m[3].bias.requires_grad_(False)  # a frozen LayerNorm bias next to a trained weight
    return m


def torch_data_parallel(mesh, device: str, shape=TINY) -> list[dict]:
    """DDP and FSDP2 (fully_shard) over a small model with frozen norm parameters, against one process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import normkit

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover  (torch < 2.6)
        from torch.distributed._composable.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    B, S, D = shape
    torch.manual_seed(1)
    x = torch.randn(B * world, S, D, device=device)
    ref = _small_model(device, D)
    (ref(x) ** 2).mean().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    local = x[rank * B:(rank + 1) * B]
    out = []

    ddp = DistributedDataParallel(_small_model(device, D), device_ids=[torch.device(device).index]
                                  if torch.device(device).type == "cuda" else None)
    with normkit.record_launches() as log:
        (ddp(local) ** 2).mean().backward()
    out.append(_dp_record("ddp", {n: p.grad for n, p in ddp.module.named_parameters()}, ref_grads, B * S, log))

    model = _small_model(device, D)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with comm_counter() as comms, normkit.record_launches() as log:
        (model(local) ** 2).mean().backward()
    grads = {n: (p.grad.full_tensor() if p.grad is not None else None) for n, p in model.named_parameters()}
    record = _dp_record("fsdp2", grads, ref_grads, B * S, log)
    record["comms"] = comms.summary()
    out.append(record)
    return out


def torch_peft_fsdp2(mesh, device: str, shape=TINY) -> list[dict]:
    """FSDP2 (``fully_shard`` per decoder layer) over a bf16 Llama with PEFT's default fp32 LoRA adapters
    on q/k/v/o, patched by normkit: the LoRA gradients against one process's unpatched model, and the
    fp32 copies the step keeps (q, k and v share their norm's: two per layer)."""
    import copy

    import peft
    import torch
    import torch.distributed as dist
    import transformers

    import torch_frontend as tf

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover  (torch < 2.6)
        from torch.distributed._composable.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, layers, seq, batch = 32, 2, 8, 2
    torch.manual_seed(3)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           init_lora_weights=False)
    ref = peft.get_peft_model(base.to(device, torch.bfloat16), lora)
    model = copy.deepcopy(ref)
    report = tf.patch_model(model)
    ids = torch.randint(0, 64, (batch * world, seq), generator=torch.Generator().manual_seed(4)).to(device)
    ref(input_ids=ids, labels=ids).loss.backward()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = ids[rank * batch:(rank + 1) * batch]
    kept: dict = {}

    def pack(t):
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == hidden and t.numel() == batch * seq * hidden:
            kept[t.untyped_storage().data_ptr()] = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=local, labels=local).loss
    loss.backward()
    errs = {}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            g, rg = p.grad.full_tensor().float(), ref_params[name].grad.float()
            scale = float(rg.abs().max())  # a bf16 model's gradients: relative to their scale
            errs[name] = _err(g / scale, rg / scale, "bfloat16", name, reduced_over=batch * world * seq)
    return [{"kind": "peft_fsdp2", "name": "peft_fsdp2", "errors": errs, "shares": len(report.shares),
             "fp32_kept": len(kept), "layers": layers}]


def _dp_record(name, grads: dict, ref_grads: dict, rows: int, log) -> dict:
    errs = {}
    for n, rg in ref_grads.items():
        g = grads.get(n)
        if (g is None) != (rg is None):
            errs[n] = {"ok": False, "message": f"gradient presence differs: {g is not None} vs {rg is not None}"}
        elif g is not None:
            errs[n] = _err(g.detach().float().cpu(), rg.float().cpu(), "float32", n, reduced_over=rows)
    return {"kind": "data_parallel", "name": name, "errors": errs,
            "frozen_without_grad": sorted(n for n, g in ref_grads.items() if g is None and grads.get(n) is None),
            # per backward launch, by kernel: whether it read the output (the RMSNorm, its weight frozen)
            "backward_from_output": sorted((launch.kernel, bool(launch.flags.get("FROM_Y")))
                                           for launch in log if "bwd" in launch.kernel)}


def torch_cases(device: str, shape=TINY, dtype_name: str = "float32") -> list[dict]:
    """Every torch case, on this rank of an initialized process group (world size 2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch_device_type(device), (dist.get_world_size(),))
    out = []
    for name, op_name, placement, kind, trained in TORCH_CASES:
        try:
            out.append(torch_case(mesh, name, op_name, placement, _case_shape(kind, shape), trained, device,
                                  dtype_name))
        except Exception:  # noqa: BLE001  (one broken case must not hide the others)
            out.append({"kind": "dtensor", "name": name, "crash": traceback.format_exc()[-3000:]})
    for fn in (torch_error_cases, torch_sequence_parallel_module, torch_data_parallel, torch_peft_fsdp2):
        try:
            out.extend(fn(mesh, device, shape))
        except Exception:  # noqa: BLE001
            out.append({"kind": fn.__name__, "name": fn.__name__, "crash": traceback.format_exc()[-3000:]})
    return out


def torch_device_type(device: str) -> str:
    return device.split(":")[0]


ERROR_EXPECTATIONS = {  # case -> (exception type, words the message must contain)
    "x_sharded_on_normalized_dim": ("ValueError", ("x has placements", "Shard(dim=2)", "normalized")),
    "x_partial": ("ValueError", ("x has placements", "Partial", "partial sum")),
    "weight_sharded": ("ValueError", ("weight has placements", "Shard(dim=0)", "tensor-parallel")),
    "weight_plain_tensor": ("TypeError", ("weight is a plain torch.Tensor", "DTensor")),
    "residual_sharded_on_normalized_dim": ("ValueError", ("residual has placements", "normalized")),
}


def torch_failures(case: dict) -> list[str]:
    """What is wrong with one torch case's result (empty: it passes)."""
    name = case["name"]
    if "crash" in case:
        return [f"{name} crashed:\n{case['crash']}"]
    bad = [f"{name}: {k}: {v.get('message')}" for k, v in case.get("errors", {}).items() if not v.get("ok")]
    kind = case["kind"]
    if kind == "dtensor":
        sharded = case["placement"] != "R"
        trained_params = [p for p in case["params"] if p in case["trained"]]
        if case["comms"]["forward"] or case["comms"]["backward"]:
            bad.append(f"{name}: collectives in the forward/backward: {case['comms']}")
        expect = {"all_reduce": len(trained_params)} if sharded and trained_params else {}
        if case["comms"]["reduce"] != expect:
            bad.append(f"{name}: reducing the gradients ran {case['comms']['reduce']}, expected {expect}")
        for p in case["params"]:
            got = case["grad_placements"][p]
            want = None if p not in case["trained"] else "(Partial(sum),)" if sharded else "(Replicate(),)"
            if got != want:
                bad.append(f"{name}: {p}.grad placements {got}, expected {want}")
        # save="auto": the backward keeps the output exactly when every parameter is frozen (and safe)
        want_output = not trained_params and name not in UNSAFE_CASES
        if case["backward_from_output"] != [want_output] * len(case["backward_from_output"]) or not \
                case["backward_from_output"]:
            bad.append(f"{name}: backward launches read the output: {case['backward_from_output']}, expected "
                       f"{want_output} in each")
        for o in ("y", "residual_out"):
            if o in case["errors"] and case["errors"][o]["placements"] != str((_placement(case["placement"]),)):
                bad.append(f"{name}: {o} placements {case['errors'][o]['placements']}")
    elif kind == "error":
        want_type, words = ERROR_EXPECTATIONS[name]
        err = case["error"] or ""
        if not err.startswith(want_type + ":") or not all(w in err for w in words):
            bad.append(f"{name}: expected {want_type} mentioning {words}; got {err or 'no error'}")
        if case["launches"]:
            bad.append(f"{name}: {case['launches']} kernel launches before the error")
    elif kind == "sp_module":
        expect = {"all_reduce": 1} if case["trained"] else {}
        if case["comms"]["backward"] or case["comms"]["step"] != expect:
            bad.append(f"{name}: collectives {case['comms']}, expected none in backward and {expect} in the step")
        if case["output_placements"] != "(Shard(dim=1),)":
            bad.append(f"{name}: output placements {case['output_placements']}")
    elif kind == "data_parallel":
        frozen = {"1.weight", "3.bias"}
        if set(case["frozen_without_grad"]) != frozen:
            bad.append(f"{name}: parameters without gradient {case['frozen_without_grad']}, expected {sorted(frozen)}")
        # the RMSNorm (weight frozen) keeps its output; the LayerNorm (weight trained) its input
        if sorted(f for _, f in case["backward_from_output"]) != [False, True]:
            bad.append(f"{name}: backward launches reading the output: {case['backward_from_output']}, expected "
                       "the RMSNorm's alone")
    elif kind == "peft_fsdp2":
        if not case["errors"]:
            bad.append(f"{name}: no LoRA gradient compared")
        if case["shares"] != case["layers"] or case["fp32_kept"] != 2 * case["layers"]:
            bad.append(f"{name}: {case['shares']} norms share their copy and {case['fp32_kept']} fp32 inputs are kept; "
                       f"expected {case['layers']} and {2 * case['layers']} (q/k/v's shared copy and o_proj's)")
    return bad


def _torch_rank(rank: int, world: int, init_method: str, out_dir: str, device: str) -> None:
    """One spawned CPU rank: gloo, the torch cases, results to ``out_dir/rank{rank}.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    try:
        cases = torch_cases(device)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(cases, indent=1))


def spawn_cpu_ranks(fn, world: int, *args) -> None:
    """``fn(rank, world, init_method, *args)`` in ``world`` spawned processes. The ranks meet through a
    file in a fresh directory (``file://`` rendezvous), not a TCP port: a port found free here could
    be taken by another process before the ranks bind it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as rendezvous:
        init_method = Path(rendezvous, "store").as_uri()
        mp.start_processes(fn, args=(world, init_method, *args), nprocs=world, join=True, start_method="spawn")


def run_torch_cpu(out: Path, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        spawn_cpu_ranks(_torch_rank, world, tmp, "cpu")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    cases = ranks[0]
    for r, other in enumerate(ranks[1:], 1):  # every rank judges its own results
        for case, theirs in zip(cases, other):
            case.setdefault("other_ranks_failures", []).extend(
                f"rank {r}: {f}" for f in torch_failures(theirs))
    out.write_text(json.dumps(cases, indent=1))
    return cases


# =============================================================================================
# JAX.

JAX_IMPLEMENTATIONS = ("triton", "pallas", "xla")  # jax_frontend.IMPLEMENTATIONS (not imported: this module loads without JAX)
JAX_PLACEMENTS = ("set_mesh", "device_put", "in_shardings")
JAX_MESH = ((2,), ("data",))
JAX_SPECS = {"batch": ("data", None, None), "seq": (None, "data", None)}


def _jax_case_table() -> list[tuple]:
    """(name, implementation, op, mesh axis type, placement, x's PartitionSpec entries, mesh shape and
    axis names): every implementation x op on a 2-device mesh of Auto axes and one of Explicit axes.
    The inputs are placed three ways (under ``jax.set_mesh`` with ``device_put``; ``device_put``
    alone; ``jit(in_shardings=...)`` on host arrays) and x is split along its batch or its sequence
    axis, rotating so that each op and each implementation meets every placement on each axis type,
    and both splits. Then two-axis meshes: rows split over one axis and replicated over the other,
    and rows split over both."""
    table = []
    for ii, implementation in enumerate(JAX_IMPLEMENTATIONS):
        for oi, op_name in enumerate(sorted(OPS)):
            for ai, axis_type in enumerate(("auto", "explicit")):
                placement = JAX_PLACEMENTS[(ii + oi + ai) % 3]
                split = ("batch", "seq")[(ii + oi + ai) % 2]
                table.append((f"{op_name}_{implementation}_{axis_type}_{placement}_{split}", implementation, op_name,
                              axis_type, placement, JAX_SPECS[split], JAX_MESH))
    table += [
        ("rms_norm_triton_auto_device_put_2d_data_model", "triton", "rms_norm", "auto", "device_put",
         ("data", None, None), ((2, 1), ("data", "model"))),
        ("layer_norm_triton_auto_set_mesh_2d_data_sp", "triton", "layer_norm", "auto", "set_mesh",
         ("data", "sp", None), ((1, 2), ("data", "sp"))),
        ("layer_norm_xla_explicit_set_mesh_2d_data_sp", "xla", "layer_norm", "explicit", "set_mesh",
         ("data", "sp", None), ((1, 2), ("data", "sp"))),
    ]
    return table


JAX_CASES = _jax_case_table()


def _jax_fn(op_name: str, implementation=None):
    """f(inputs by name) -> tuple of outputs."""
    import jax_frontend as jf

    op = OPS[op_name]
    fn = getattr(jf, op_name)

    def outputs(a: dict) -> tuple:
        out = fn(*(a.get(n) for n in op.inputs), implementation=implementation)
        return out if op.has_residual else (out,)

    return outputs


def _spec_str(spec) -> str:
    """A PartitionSpec without trailing Nones (``P('data', None)`` and ``P('data',)`` are one placement)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return str(tuple(entries))


def _placed(placement: str, mesh, shardings, fn, *host_args):
    """(jitted fn, its arguments) for inputs placed as ``placement`` says (see ``_jax_case_table``)."""
    import jax

    if placement == "in_shardings":
        return jax.jit(fn, in_shardings=shardings), host_args
    return jax.jit(fn), jax.device_put(host_args, shardings)


def jax_case(name: str, implementation: str, op_name: str, axis_type: str, placement: str, spec: tuple,
             mesh_def=JAX_MESH, shape=TINY, devices=None) -> dict:
    """One op through one implementation on a 2-device mesh: the forward with every input trained, and
    the backward with the parameters frozen by ``jax.lax.stop_gradient`` and by ``jax_frontend.freeze``,
    each jitted once; results against the float64 reference and against the unsharded run, and the
    compiled HLO's collectives."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf
    from normkit.testing import random_inputs

    op = OPS[op_name]
    data = random_inputs(op, tuple(shape), "float32", np.random.default_rng(_seed(name)))
    inputs = {n: np.asarray(data[n], np.float32) for n in op.inputs}
    cots = tuple(np.asarray(data[k], np.float32) for k in (("dy", "ds") if op.has_residual else ("dy",)))
    outputs = _jax_fn(op_name, implementation)

    def loss(a, cots):
        return sum(jnp.sum(o * c) for o, c in zip(outputs(a), cots))

    def trained(a, cots):  # the outputs and every input's gradient
        return outputs(a), jax.grad(loss)(a, cots)

    def frozen(a, cots):  # the row inputs' gradients, parameters frozen two ways
        rows = {n: a[n] for n in op.row_inputs}
        stopped = {p: jax.lax.stop_gradient(a[p]) for p in op.params}
        by_stop = jax.grad(lambda r: loss({**r, **stopped}, cots))(rows)
        mask = {n: n in op.row_inputs for n in op.inputs}
        by_freeze = jax.grad(lambda a: loss(jf.freeze(a, mask), cots))(a)
        return by_stop, by_freeze

    axis = AxisType.Auto if axis_type == "auto" else AxisType.Explicit
    mesh = jax.make_mesh(*mesh_def, axis_types=(axis,) * len(mesh_def[0]), devices=devices)
    row = NamedSharding(mesh, P(*spec))
    in_sharding = ({n: row if n in op.row_inputs else NamedSharding(mesh, P()) for n in op.inputs},
                   tuple(row for _ in cots))
    context = jax.set_mesh(mesh) if placement == "set_mesh" else contextlib.nullcontext()
    results, hlo = {}, {}
    with context:
        for label, fn in (("trained", trained), ("frozen", frozen)):
            f, args = _placed(placement, mesh, in_sharding, fn, inputs, cots)
            results[label] = f(*args)
            hlo[label] = collectives(f.lower(*args).compile().as_text(), (shape[-1],))
    unsharded = {label: jax.jit(fn)(inputs, cots) for label, fn in (("trained", trained), ("frozen", frozen))}

    ref_out, ref_grads = op.run_reference(inputs, op.options(eps=op.default_eps), dict(zip(op.outputs, cots)))
    (outs, grads), (by_stop, by_freeze) = results["trained"], results["frozen"]
    (u_outs, u_grads), (u_stop, _) = unsharded["trained"], unsharded["frozen"]
    M = int(np.prod(shape[:-1]))
    checks = [(o, outs[i], ref_out[o], u_outs[i]) for i, o in enumerate(op.outputs)]
    checks += [("d" + n, grads[n], ref_grads[n], u_grads[n]) for n in op.inputs]
    checks += [(f"d{n} (params frozen by stop_gradient)", by_stop[n], ref_grads[n], u_stop[n]) for n in op.row_inputs]
    checks += [(f"d{n} (params frozen by freeze)", by_freeze[n], ref_grads[n], u_stop[n]) for n in op.row_inputs]
    results = {}
    for what, got, ref, plain in checks:
        column = what in ("dweight", "dbias")
        want = NamedSharding(mesh, P() if column else P(*spec))  # mesh axes of size 1 place nothing
        results[what] = {**_err(np.asarray(got), ref, "float32", what, M if column else 1),
                         "layout": "column" if column else "row", "spec": _spec_str(got.sharding.spec),
                         "placed_as_expected": got.sharding.is_equivalent_to(want, got.ndim),
                         "unsharded_diff": float(np.abs(np.asarray(got, np.float64) - np.asarray(plain)).max()),
                         "unsharded": _err(np.asarray(got), np.asarray(plain), "float32", what, M if column else 1)}
    return {"kind": "sharded", "name": name, "implementation": implementation, "op": op_name, "axis_type": axis_type,
            "placement": placement, "spec": _spec_str(spec), "params": list(op.params),
            "N": shape[-1], "results": results, "collectives": hlo,
            "frozen_param_grads_max": [float(np.abs(np.asarray(by_freeze[p])).max()) for p in op.params]}


def jax_fsdp(shape=TINY, devices=None) -> list[dict]:
    """A weight sharded along the normalized dimension (FSDP-style) with rows split over the same mesh
    axis, Auto and Explicit: the weight (N elements) is gathered, never the activation."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    rng = np.random.default_rng(5)
    x = np.asarray(rng.standard_normal(shape), np.float32)
    w = np.asarray(rng.uniform(0.5, 1.5, shape[-1]), np.float32)
    dy = np.asarray(rng.standard_normal(shape), np.float32)

    def step(x, w, dy):
        y, vjp = jax.vjp(jf.rms_norm, x, w)
        return (y, *vjp(dy))

    ref = jax.jit(step)(x, w, dy)
    out = []
    for axis_type, axis in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit)):
        mesh = jax.make_mesh((2,), ("data",), axis_types=(axis,), devices=devices)
        with jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext():
            args = jax.device_put((x, w, dy), (NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")),
                                               NamedSharding(mesh, P("data"))))
            f = jax.jit(step)
            got = f(*args)
            hlo = collectives(f.lower(*args).compile().as_text(), (shape[-1],))
        M = int(np.prod(shape[:-1]))
        errs = {k: _err(np.asarray(g), np.asarray(r), "float32", k, M if k == "dweight" else 1)
                for k, g, r in zip(("y", "dx", "dweight"), got, ref)}
        out.append({"kind": "fsdp", "name": f"fsdp_weight_{axis_type}", "N": shape[-1], "errors": errs,
                    "collectives": hlo, "dweight_spec": _spec_str(got[2].sharding.spec), "axis_type": axis_type})
    return out


def jax_vmap(shape=TINY, devices=None) -> list[dict]:
    """vmap over a split axis, Auto and Explicit: the batch axis folds into the rows and stays split;
    the forward and a frozen weight's backward move nothing."""
    import contextlib

    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    rng = np.random.default_rng(6)
    x = np.asarray(rng.standard_normal(shape), np.float32)
    w = np.asarray(rng.uniform(0.5, 1.5, shape[-1]), np.float32)
    dy = np.asarray(rng.standard_normal(shape), np.float32)

    def step(x, w, dy):
        y, vjp = jax.vjp(jax.vmap(lambda x: jf.rms_norm(x, w)), x)
        return y, vjp(dy)[0]

    ref = jax.jit(step)(x, w, dy)
    out = []
    for axis_type, axis in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit)):
        mesh = jax.make_mesh((2,), ("data",), axis_types=(axis,), devices=devices)
        with jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext():
            args = jax.device_put((x, w, dy), (NamedSharding(mesh, P("data")), NamedSharding(mesh, P()),
                                               NamedSharding(mesh, P("data"))))
            f = jax.jit(step)
            got = f(*args)
            hlo = collectives(f.lower(*args).compile().as_text(), (shape[-1],))
        out.append({"kind": "vmap", "name": f"vmap_{axis_type}", "collectives": hlo,
                    "errors": {k: _err(np.asarray(g), np.asarray(r), "float32", k)
                               for k, g, r in zip(("y", "dx"), got, ref)},
                    "specs": [_spec_str(g.sharding.spec) for g in got], "spec": _spec_str(P("data"))})
    return out


def jax_eager_auto(shape=TINY, devices=None) -> list[dict]:
    """Outside jit, arrays sequence-split on an Auto mesh: each implementation's forward and backward
    still run per device (outputs and dx split like x)."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    rng = np.random.default_rng(4)
    x = np.asarray(rng.standard_normal(shape), np.float32)
    w = np.asarray(rng.uniform(0.5, 1.5, shape[-1]), np.float32)
    dy = np.asarray(rng.standard_normal(shape), np.float32)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    row = NamedSharding(mesh, P(None, "data"))
    out = []
    for implementation in runnable_implementations():
        def step(x, w, dy, implementation=implementation):
            y, vjp = jax.vjp(lambda x, w: jf.rms_norm(x, w, implementation=implementation), x, w)
            return (y, *vjp(dy))

        ref = jax.jit(step)(x, w, dy)
        got = step(jax.device_put(x, row), w, jax.device_put(dy, row))
        M = int(np.prod(shape[:-1]))
        out.append({"kind": "eager", "name": f"eager_auto_{implementation}", "spec": _spec_str(row.spec),
                    "specs": [_spec_str(g.sharding.spec) for g in got[:2]],
                    "errors": {k: _err(np.asarray(g), np.asarray(r), "float32", k, M if k == "dweight" else 1)
                               for k, g, r in zip(("y", "dx", "dweight"), got, ref)}})
    return out


def jax_gspmd(shape=TINY, devices=None) -> list[dict]:
    """The rule under the GSPMD partitioner (``jax_use_shardy_partitioner=False``; Shardy is the default):
    a trained LayerNorm, batch-split, on an Auto mesh."""
    import jax

    if "triton" not in runnable_implementations():
        return []
    saved = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        case = jax_case("layer_norm_triton_auto_device_put_batch_gspmd", "triton", "layer_norm", "auto", "device_put",
                        JAX_SPECS["batch"], shape=shape, devices=devices)
    finally:
        jax.config.update("jax_use_shardy_partitioner", saved)
    return [case]


def jax_user_shard_map(shape=TINY, devices=None) -> list[dict]:
    """normkit inside the caller's own shard_map on an Auto mesh (the rows are local there)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), jnp.float32)

    def loss_local(x, w):
        return jax.lax.psum(jnp.sum(jf.rms_norm(x, w) ** 2), "data")

    out = []
    for trained in (True, False):
        argnums = (0, 1) if trained else (0,)
        sm = jax.shard_map(loss_local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
        f = jax.jit(jax.grad(sm, argnums=argnums))
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P()))
        grads = f(xs, ws)
        ref = jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w) ** 2), argnums=argnums)(x, w)
        errs = {"dx": _err(np.asarray(grads[0]), np.asarray(ref[0]), "float32", "dx")}
        if trained:
            errs["dweight"] = _err(np.asarray(grads[1]), np.asarray(ref[1]), "float32", "dweight",
                                   reduced_over=int(np.prod(shape[:-1])))
        out.append({"kind": "user_shard_map", "name": f"user_shard_map_{'trained' if trained else 'frozen'}",
                    "trained": ["x", "weight"] if trained else ["x"], "errors": errs,
                    "backward_hlo": collectives(f.lower(xs, ws).compile().as_text(), (shape[-1],))})
    return out


def jax_replicated(shape=TINY, devices=None) -> list[dict]:
    """Replicated inputs on a 2-device Explicit mesh (what arrays made after ``jax.set_mesh`` are), eager
    and under jit, each implementation: bitwise the unsharded results, and no collective at all."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    rng = np.random.default_rng(11)
    x = np.asarray(rng.standard_normal(shape), np.float32)
    w = np.asarray(rng.uniform(0.5, 1.5, shape[-1]), np.float32)
    b = np.asarray(0.1 * rng.standard_normal(shape[-1]), np.float32)
    mesh = jax.make_mesh((2,), ("sp",), devices=devices)
    out = []
    for impl in (None, "pallas", "xla"):
        def grads(x, w, b, impl=impl):
            return jax.grad(lambda x, w, b: jnp.sum(jnp.sin(jf.layer_norm(x, w, b, implementation=impl))),
                            argnums=(0, 1, 2))(x, w, b)

        ref = [np.asarray(g) for g in grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b))]
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, NamedSharding(mesh, P())) for a in (x, w, b)]
            case = {"kind": "replicated", "name": f"replicated_{impl or 'auto'}", "diff": {}}
            for mode, fn in (("eager", grads), ("jit", jax.jit(grads))):
                got = [np.asarray(g) for g in fn(*args)]
                case["diff"][mode] = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))
            case["hlo"] = collectives(jax.jit(grads).lower(*args).compile().as_text(), (shape[-1],))
        out.append(case)
    return out


JAX_ERROR_EXPECTATIONS = {
    "x_sharded_on_normalized_dim": ("ValueError", "normalized (last) dimension is sharded"),
    "residual_sharded_differently": ("ValueError", "residual has sharding", "sharded alike"),
}


def jax_error_cases(shape=TINY, devices=None) -> list[dict]:
    """Placements the kernels cannot run on locally, in the inputs' types (Explicit axes): a ValueError
    when the op is traced. (With Auto axes the placement is the partitioner's: ``jax_hidden_split``.)"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    mesh = jax.make_mesh((2,), ("sp",), devices=devices)
    x = jnp.ones(shape, jnp.float32)
    w = jnp.ones(shape[-1], jnp.float32)
    out = []
    with jax.set_mesh(mesh):
        xs, ws = jax.device_put(x, P(None, "sp")), jax.device_put(w, P())
        cases = {
            "x_sharded_on_normalized_dim": lambda: jax.jit(jf.rms_norm)(jax.device_put(x, P(None, None, "sp")), ws),
            "residual_sharded_differently": lambda: jax.jit(jf.fused_add_rms_norm)(
                xs, jax.device_put(x, P("sp")), ws),
        }
        for name, fn in cases.items():
            out.append(_error_case(name, fn))
    return out


JAX_HIDDEN_SPLIT = {  # case -> (how x's normalized dimension comes to be split, the op)
    "hidden_split_committed": ("committed", "layer_norm"),  # x placed so, then jit
    "hidden_split_constrained": ("constrained", "fused_add_rms_norm"),  # rows split, then constrained under jit
}
JAX_HIDDEN_SPLIT_ERRORS = {  # outside jit the committed placement is known: refused
    "hidden_split_eager": ("ValueError", "x of shape", "P(None, None, 'sp')", "normalized (last) dimension is sharded",
                           "leading (batch or sequence) dimensions"),
}
GATHER_WARNING = ("splits its normalized (last) dimension", "all-gather of x", "leading (batch or sequence)")


@contextlib.contextmanager
def _logged(logger_name: str):
    """The messages logged to ``logger_name`` inside the block (a list, filled as they come)."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def jax_hidden_split(shape=TINY, devices=None) -> list[dict]:
    """x split along its normalized (last) dimension on a 2-device Auto mesh, under the partitioner
    this process runs: Shardy (jax's default) or GSPMD (``JAX_USE_SHARDY_PARTITIONER=false``). A Python
    exception in GSPMD's sharding callback aborts the process, so the tests run this group in a
    subprocess of its own for each partitioner.

    Under ``jit`` (x committed to ``P(None, None, "sp")``, or its rows split and x constrained so
    inside the function) the sharding is chosen after tracing: the rule asks for the normalized
    dimension whole, the partitioner gathers it, and the outputs and every input's gradient match
    the float64 reference and the unsharded run; the rule logs a warning naming the gather. Outside
    ``jit`` the committed placement is known: a ValueError naming x's sharding, before any launch."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf

    partitioner = "shardy" if jax.config.jax_use_shardy_partitioner else "gspmd"
    implementation = runnable_implementations()[0]  # triton where it runs: its CPU route has the most to lose
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=devices)
    out = []
    for name, (how, op_name) in JAX_HIDDEN_SPLIT.items():
        try:
            case = _hidden_split_case(name, how, op_name, implementation, mesh, shape)
        except Exception:  # noqa: BLE001
            case = {"kind": "hidden_split", "name": name, "crash": traceback.format_exc()[-3000:]}
        out.append({**case, "partitioner": partitioner})
    rng = np.random.default_rng(_seed("hidden_split_eager"))
    x = jax.device_put(np.asarray(rng.standard_normal(shape), np.float32), NamedSharding(mesh, P(None, None, "sp")))
    w = np.asarray(rng.uniform(0.5, 1.5, shape[-1]), np.float32)
    case = _error_case("hidden_split_eager", lambda: jf.rms_norm(x, w, implementation=implementation))
    out.append({**case, "partitioner": partitioner})
    return out


def _hidden_split_case(name: str, how: str, op_name: str, implementation: str, mesh, shape) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from normkit.testing import poisoned_outputs, random_inputs

    op = OPS[op_name]
    data = random_inputs(op, tuple(shape), "float32", np.random.default_rng(_seed(name)))
    inputs = {n: np.asarray(data[n], np.float32) for n in op.inputs}
    cots = tuple(np.asarray(data[k], np.float32) for k in (("dy", "ds") if op.has_residual else ("dy",)))
    outputs = _jax_fn(op_name, implementation)
    hidden = NamedSharding(mesh, P(None, None, "sp"))

    def run(a, cots, constrain: bool):  # the outputs and every input's gradient
        if constrain:
            a = {**a, "x": jax.lax.with_sharding_constraint(a["x"], hidden)}
        outs, vjp = jax.vjp(outputs, a)
        return outs, vjp(cots)[0]

    rows = hidden if how == "committed" else NamedSharding(mesh, P("sp"))
    placed = jax.device_put((inputs, cots), ({n: rows if n in op.row_inputs else NamedSharding(mesh, P())
                                              for n in op.inputs}, tuple(rows for _ in cots)))
    with _logged("jax_frontend._custom_partitioning") as logged, poisoned_outputs():  # compiled, hence poisoned, here
        outs, grads = jax.jit(run, static_argnums=2)(*placed, how == "constrained")
        outs, grads = jax.block_until_ready((outs, grads))
    plain_outs, plain_grads = jax.jit(run, static_argnums=2)(inputs, cots, False)  # one device
    ref_out, ref_grads = op.run_reference(inputs, op.options(eps=op.default_eps), dict(zip(op.outputs, cots)))
    M = int(np.prod(shape[:-1]))
    checks = [(o, outs[i], ref_out[o], plain_outs[i], 1) for i, o in enumerate(op.outputs)]
    checks += [("d" + n, grads[n], ref_grads[n], plain_grads[n], M if n in op.params else 1) for n in op.inputs]
    errors = {}
    for what, got, ref, plain, reduced_over in checks:
        errors[what] = _err(np.asarray(got), ref, "float32", what, reduced_over)
        # Every row is whole on the device that normalizes it: the Triton kernels' row results bitwise
        # as on one device; dW/dB (summed per device, then across devices, wherever the partitioner
        # splits the rows) and the other implementations within the tolerance table.
        diff = float(np.abs(np.asarray(got, np.float64) - np.asarray(plain, np.float64)).max())
        errors[f"{what} against the unsharded run"] = (
            {"ok": diff == 0.0, "message": f"differs by {diff}"} if implementation == "triton" and reduced_over == 1
            else _err(np.asarray(got), np.asarray(plain), "float32", what, reduced_over))
    return {"kind": "hidden_split", "name": name, "implementation": implementation, "op": op_name, "how": how,
            "errors": errors, "logged": logged}


def _error_case(name: str, fn) -> dict:
    import normkit

    with normkit.record_launches() as log:
        try:
            fn()
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    return {"kind": "error", "name": name, "error": err, "launches": len(log)}


def runnable_implementations() -> tuple:
    """The JAX implementations this install can run: on CPU, ``triton`` needs torch (Triton's
    interpreter); a JAX-only install runs ``pallas`` and ``xla``."""
    import jax_frontend as jf

    out = []
    for implementation in JAX_IMPLEMENTATIONS:
        try:
            jf.resolve_implementation(implementation)
        except RuntimeError:
            continue
        out.append(implementation)
    return tuple(out)


def jax_cases(shape=TINY, devices=None) -> list[dict]:
    out = []
    runnable = runnable_implementations()
    for name, *spec in JAX_CASES:
        if spec[0] not in runnable:
            continue
        try:
            out.append(jax_case(name, *spec, shape=shape, devices=devices))
        except Exception:  # noqa: BLE001
            out.append({"kind": "sharded", "name": name, "crash": traceback.format_exc()[-3000:]})
    for fn in (jax_fsdp, jax_vmap, jax_eager_auto, jax_gspmd, jax_user_shard_map, jax_replicated,
               jax_error_cases):
        try:
            out.extend(fn(shape, devices))
        except Exception:  # noqa: BLE001
            out.append({"kind": fn.__name__, "name": fn.__name__, "crash": traceback.format_exc()[-3000:]})
    return out


JAX_GROUPS = {"all": jax_cases, "hidden_split": jax_hidden_split}


def _moves_activation(h: dict, N: int, reduced: int) -> bool:
    """Whether the collectives ``h`` (``tests.hlo.collectives``) move more than N-element parameter
    vectors and their gradients (``reduced`` of them all-reduced; XLA on GPU may merge dW and dB into
    one all-reduce of 2N elements, so elements are counted): an activation gathered, permuted, or
    all-reduced."""
    return bool(h["all_to_all"] or h["collective_permute"] or sum(h["all_reduce_elements"]) > N * reduced
                or any(not a.endswith(f"[{N}]") for a in h["all_gather_arrays"]))


def _any_collective(h: dict) -> bool:
    return bool(h["all_reduce_ops"] or h["all_gather"] or h["reduce_scatter"] or h["all_to_all"]
                or h["collective_permute"])


def jax_failures(case: dict) -> list[str]:
    """What is wrong with one JAX case's result (empty: it passes)."""
    name = case["name"]
    if "crash" in case:
        return [f"{name} crashed:\n{case['crash']}"]
    bad = [f"{name}: {k}: {v.get('message')}" for k, v in case.get("errors", {}).items() if not v.get("ok")]
    kind = case["kind"]
    if kind == "sharded":
        N, params = case["N"], case["params"]
        for what, r in case["results"].items():
            if not r["ok"]:
                bad.append(f"{name}: {what}: {r['message']}")
            if not r["placed_as_expected"]:
                want = case["spec"] if r["layout"] == "row" else "()"
                bad.append(f"{name}: {what} is sharded {r['spec']}, expected {want}")
            # Against the unsharded run of the same jitted function: the Triton kernels run each row alike
            # on any number of rows, so their row results are bitwise equal; anything else within the
            # tolerance table (XLA may fuse differently for other shapes; dW/dB sum in another order).
            if r["layout"] == "row" and case["implementation"] == "triton" and r["unsharded_diff"]:
                bad.append(f"{name}: {what} differs from the unsharded run by {r['unsharded_diff']}")
            elif not r["unsharded"]["ok"]:
                bad.append(f"{name}: {what} against the unsharded run: {r['unsharded']['message']}")
        trained, frozen = case["collectives"]["trained"], case["collectives"]["frozen"]
        # Each trained parameter's gradient reduced once (XLA may merge them into one instruction), and
        # nothing else moved.
        if (trained["all_gather"] or trained["reduce_scatter"] or _moves_activation(trained, N, len(params))
                or sum(trained["all_reduce_elements"]) != N * len(params)):
            bad.append(f"{name}: collectives {trained}; expected one all-reduce of {N} elements for each of {params}")
        if _any_collective(frozen):
            bad.append(f"{name}: collectives with the parameters frozen: {frozen}")
        if any(case["frozen_param_grads_max"]):
            bad.append(f"{name}: frozen parameters got gradients {case['frozen_param_grads_max']}")
    elif kind == "fsdp":
        # The weight's N elements gathered; its gradient all-reduced, or reduce-scattered to the weight's
        # sharding (XLA may turn the all-reduce and the slice that follows into one reduce-scatter).
        N, found = case["N"], case["collectives"]
        if _moves_activation(found, N, 1) or not found["all_gather_arrays"]:
            bad.append(f"{name}: collectives {found}; expected the {N}-element weight gathered, no activation moved")
        if case["axis_type"] == "explicit" and case["dweight_spec"] != "('data',)":
            bad.append(f"{name}: dweight is sharded {case['dweight_spec']}, expected the weight's ('data',)")
    elif kind in ("vmap", "eager"):
        if "collectives" in case and _any_collective(case["collectives"]):
            bad.append(f"{name}: collectives {case['collectives']}; expected none")
        if any(s != case["spec"] for s in case["specs"]):
            bad.append(f"{name}: outputs sharded {case['specs']}, expected {case['spec']}")
    elif kind == "user_shard_map":
        h = case["backward_hlo"]
        want = 1 if "weight" in case["trained"] else 0
        if h["all_gather"] or h["param_reductions"] != want:
            bad.append(f"{name}: backward collectives {h}; expected {want} all-reduce of the weight's shape")
    elif kind == "replicated":
        h = case["hlo"]
        if h["all_reduce_ops"] or h["all_gather"] or h["all_to_all"] or h["collective_permute"]:
            bad.append(f"{name}: collectives for replicated inputs: {h}")
        # triton and pallas run the same kernel on the same rows: bitwise; xla may fuse differently under jit
        tol = 1e-5 if name.endswith("xla") else 0.0
        if any(d > tol for d in case["diff"].values()):
            bad.append(f"{name}: gradients differ from the unsharded run by {case['diff']} (allowed {tol})")
    elif kind == "hidden_split":
        if not any(all(w in m for w in GATHER_WARNING) for m in case["logged"]):
            bad.append(f"{name}: expected a warning naming the gather ({GATHER_WARNING}); logged {case['logged']}")
    elif kind == "error":
        err = case["error"] or ""
        exc, *words = {**JAX_ERROR_EXPECTATIONS, **JAX_HIDDEN_SPLIT_ERRORS}[name]
        if not err.startswith(exc + ":") or not all(w in err for w in words + ["normkit:"]):
            bad.append(f"{name}: expected {exc} mentioning {words}; got {err[:2000] or 'no error'}")
        if case["launches"]:
            bad.append(f"{name}: {case['launches']} kernel launches before the error")
    return bad


# =============================================================================================


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("frontend", choices=("torch", "jax"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--group", choices=tuple(JAX_GROUPS), default="all",
                        help="jax: the cases to run (hidden_split: x split along its normalized dimension)")
    args = parser.parse_args(argv)
    if args.frontend == "torch":
        run_torch_cpu(args.out)
    else:
        import jax

        if len(jax.devices()) < 2:
            raise SystemExit("normkit: the JAX cases need 2 devices: set "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=2 before starting Python")
        args.out.write_text(json.dumps(JAX_GROUPS[args.group](devices=jax.devices()[:2]), indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "jax":
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
