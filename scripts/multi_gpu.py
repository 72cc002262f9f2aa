"""Two-GPU check: the distributed tests' cases compiled, and a sequence-parallel LoRA step, frozen vs
trained norms (docs/MULTI_GPU.md).

``torch`` (one process per GPU under torchrun, NCCL): the cases of tests/dist_workers.py at a larger
shape, then a LoRA step of a small random-init Llama (benchmarks.models.llama_lora) under tensor +
sequence parallelism, norms from normkit or HF, frozen and trained: median step time and each phase's
collectives (``CommDebugMode``). ``jax`` (one process, 2 GPUs): the JAX cases, then sharded RMSNorm
against XLA's jnp norm, weight trained and frozen: median times and the compiled HLO's all-reduces.

    python scripts/multi_gpu.py --out multi_gpu.json                    # both parts (torchrun for torch)
    torchrun --nproc-per-node 2 scripts/multi_gpu.py torch --out torch.json
    python scripts/multi_gpu.py jax --out jax.json
    python scripts/multi_gpu.py --dry-run --out dry.json                # CPU: gloo ranks, 2 host devices, tiny

The JSON has ``torch`` and ``jax`` sections (``cases``, ``failures``, ``bench``); exit status 1 when any
case failed.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.models import llama_lora  # noqa: E402
from benchmarks.timing import Timer  # noqa: E402
from tests import dist_workers  # noqa: E402
from tests.hlo import collectives  # noqa: E402

# Shapes and model sizes: the GPU run, and the CPU dry run (Triton's interpreter: tiny).
FULL = dict(case_shape=(2, 64, 512), dtype="bfloat16", warmup=3, steps=10,
            llama=dict(hidden=2048, intermediate=5632, layers=4, heads=16, kv_heads=8, vocab=32000), batch=2,
            seq=4096, lora_rank=16,
            jax_shape=(4, 4096, 4096), jax_reps=20)
DRY = dict(case_shape=dist_workers.TINY, dtype="float32", warmup=1, steps=1,
           llama=dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=64), batch=2, seq=8,
           lora_rank=4,
           jax_shape=(2, 8, 32), jax_reps=1)


# =============================================================================================
# Torch: the sequence-parallel LoRA step.


LORA_TARGETS = ("q_proj", "v_proj")


def build_llama(cfg: dict, impl: str, norms_trained: bool, mesh, device, dtype):
    """The Llama of one variant (its LoRA layers inside), parallelized over ``mesh`` (tensor + sequence
    parallel)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    peft_model, _ = llama_lora(**cfg["llama"], max_positions=cfg["seq"], dtype=dtype, device=device, norms=impl,
                               r=cfg["lora_rank"], targets=LORA_TARGETS, init_lora_weights=False,
                               attn_implementation="sdpa")
    model = peft_model.get_base_model()
    plan = {"model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
        for target in LORA_TARGETS:  # the frozen projection and the adapter's B split like the projection
            plan[f"{p}self_attn.{target}.base_layer"] = ColwiseParallel()
            plan[f"{p}self_attn.{target}.lora_B.default"] = ColwiseParallel()
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:  # the adapters' A: replicated (a DTensor on a replicated input)
        for target in LORA_TARGETS:
            distribute_module(getattr(layer.self_attn, target).lora_A["default"], mesh)
    # Freeze after parallelizing: SequenceParallel re-creates the norm parameters as nn.Parameter, which
    # sets requires_grad=True.
    for name, param in model.named_parameters():
        is_norm = "norm" in name.rsplit(".", 2)[-2]
        param.requires_grad_("lora_" in name or (is_norm and norms_trained))
    return model


def reduce_partial_grads(params) -> None:
    """Reduce each ``Partial`` DTensor gradient once (to its parameter's placements), before the
    optimizer reads it: DTensor would otherwise all-reduce it again at every read (AdamW reads a
    gradient 3 times). FSDP2 does the same for its TP parameters."""
    from torch.distributed.tensor import DTensor

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)


def torch_bench(cfg: dict, mesh, device: str) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, cfg["dtype"])
    B, S = cfg["batch"], cfg["seq"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["llama"]["vocab"], (B, S + 1), generator=g).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    chunk = S // world

    def sync(_out=None):  # every rank done: a step's time is its slowest rank's
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dist.barrier()

    results = []
    for impl in ("normkit", "hf"):
        for norms_trained in (False, True):
            name = f"{impl}_norms_{'trained' if norms_trained else 'frozen'}"
            try:
                model = build_llama(cfg, impl, norms_trained, mesh, device, dtype)
                trained = [p for p in model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(trained, lr=1e-4)
                with torch.no_grad():
                    embeds = model.model.embed_tokens(inputs)  # frozen, not parallelized: every rank has it all
                    position_ids = torch.arange(S, device=device).unsqueeze(0)
                    cos_sin = model.model.rotary_emb(embeds, position_ids)
                local = embeds[:, rank * chunk:(rank + 1) * chunk].contiguous()

                def forward_loss():
                    h = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
                    for layer in model.model.layers:
                        out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
                        h = out[0] if isinstance(out, tuple) else out
                    logits = model.lm_head(model.model.norm(h))  # [B, S, V] sharded on the vocabulary
                    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

                def step(phases=None):
                    ctx = phases or (lambda _: contextlib.nullcontext())
                    opt.zero_grad(set_to_none=True)
                    with loss_parallel():
                        with ctx("forward"):
                            loss = forward_loss()
                        with ctx("backward"):
                            loss.backward()
                    with ctx("reduce_grads"):
                        reduce_partial_grads(trained)
                    with ctx("optimizer"):
                        opt.step()
                    return loss

                for _ in range(cfg["warmup"]):
                    step()
                times = [us / 1e3 for us in Timer.each(step, cfg["steps"], sync)]
                comms = {}

                @contextlib.contextmanager
                def phase(label):
                    with dist_workers.comm_counter() as counter:
                        yield
                    comms[label] = counter.summary()

                loss = step(phase)
                n_norm_params = sum(p.numel() for n, p in model.named_parameters()
                                    if "norm" in n.rsplit(".", 2)[-2])
                results.append({
                    "variant": name, "impl": impl, "norms_trained": norms_trained,
                    "step_ms_median": statistics.median(times), "step_ms": times,
                    "loss": float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()),
                    "trained_params": sum(p.numel() for p in trained), "norm_params": n_norm_params,
                    "collectives": comms,
                    "collectives_total": _totals(comms),
                })
                del model, opt
            except Exception:  # noqa: BLE001  (one broken variant must not hide the others)
                results.append({"variant": name, "crash": traceback.format_exc()[-4000:]})
    return results


def _totals(comms: dict) -> dict:
    total: dict = {}
    for per_phase in comms.values():
        for op, entry in per_phase.items():
            t = total.setdefault(op, {"count": 0, "bytes": 0})
            t["count"] += entry["count"]
            t["bytes"] += entry["bytes"]
    return total


def torch_part(device: str, cfg: dict, skip_cases: bool = False) -> dict:
    """On every rank of an initialized process group of 2: the cases and the benchmark."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cases = [] if skip_cases else dist_workers.torch_cases(device, cfg["case_shape"])
    failures = [f for c in cases for f in dist_workers.torch_failures(c)]
    mesh = init_device_mesh(dist_workers.torch_device_type(device), (dist.get_world_size(),))
    bench = torch_bench(cfg, mesh, device)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs]
    failures += [f"bench {b['variant']} crashed" for b in bench if "crash" in b]
    import torch

    return {"cases": cases, "failures": failures, "bench": bench,
            "env": {"torch": torch.__version__, "world_size": dist.get_world_size(), "device": device,
                    "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}}


def _torch_dry_rank(rank: int, world: int, init_method: str, out: str, skip_cases: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = torch_part("cpu", DRY, skip_cases)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1))


def torch_main(out: Path, dry_run: bool, skip_cases: bool) -> dict:
    if dry_run:
        dist_workers.spawn_cpu_ranks(_torch_dry_rank, 2, str(out), skip_cases)
        return json.loads(out.read_text())
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
    try:
        result = torch_part(f"cuda:{local_rank}", FULL, skip_cases)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result, indent=1))
    return result


# =============================================================================================
# JAX.


def jax_bench(cfg: dict, devices) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_frontend as jf
    from benchmarks.impls_jax import xla_fn  # XLA's RMSNorm in jnp, normkit's "llama" casting

    mesh = jax.make_mesh((2,), ("sp",), devices=devices)
    dtype = jnp.dtype(cfg["dtype"])
    shape = tuple(cfg["jax_shape"])
    rng = np.random.default_rng(0)
    results = []
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), P(None, "sp"))
        dy = jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), P(None, "sp"))
        w = jax.device_put(jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), dtype), P())
        impls = {"normkit": lambda x, w: jf.rms_norm(x, w, 1e-6), "xla": lambda x, w: xla_fn("rms_norm")(x, w)[0]}
        for name, fn in impls.items():
            for trained in (True, False):
                if trained:
                    bwd = jax.jit(lambda x, w, dy, fn=fn: jax.vjp(fn, x, w)[1](dy))
                else:
                    bwd = jax.jit(lambda x, w, dy, fn=fn: jax.vjp(lambda x: fn(x, w), x)[1](dy))
                fwd = jax.jit(fn)
                entry = {"impl": name, "weight_trained": trained, "shape": list(shape), "dtype": cfg["dtype"],
                         "spec": "P(None, 'sp', None)"}
                try:
                    for label, f, args in (("fwd", fwd, (x, w)), ("fwd_bwd", bwd, (x, w, dy))):
                        jax.block_until_ready(f(*args))
                        times = Timer.each(lambda f=f, args=args: f(*args), cfg["jax_reps"], jax.block_until_ready)
                        entry[f"{label}_ms_median"] = statistics.median(times) / 1e3
                        hlo = f.lower(*args).compile().as_text()
                        entry[f"{label}_collectives"] = collectives(hlo, (shape[-1],))
                except Exception:  # noqa: BLE001
                    entry["crash"] = traceback.format_exc()[-4000:]
                results.append(entry)
    return results


def jax_main(out: Path, dry_run: bool, skip_cases: bool) -> dict:
    import jax

    cfg = DRY if dry_run else FULL
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit(f"normkit: the JAX part needs 2 devices; found {jax.devices()}")
    cases = [] if skip_cases else dist_workers.jax_cases(cfg["case_shape"], devices)
    failures = [f for c in cases for f in dist_workers.jax_failures(c)]
    bench = jax_bench(cfg, devices)
    failures += [f"bench {b['impl']} crashed" for b in bench if "crash" in b]
    result = {"cases": cases, "failures": failures, "bench": bench,
              "env": {"jax": jax.__version__, "devices": [str(d) for d in devices]}}
    out.write_text(json.dumps(result, indent=1))
    return result


# =============================================================================================


def _run(cmd: list[str], env: dict, timeout: int) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode


def all_main(out: Path, dry_run: bool, skip_cases: bool, timeout: int) -> dict:
    """Both parts, each in its own process(es): torchrun (or, dry, spawned gloo ranks), then JAX."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--dry-run"] * dry_run + ["--skip-cases"] * skip_cases
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        t_out, j_out = Path(tmp, "torch.json"), Path(tmp, "jax.json")
        if dry_run:
            torch_cmd = [sys.executable, __file__, "torch", "--out", str(t_out), *extra]
        else:
            torch_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         __file__, "torch", "--out", str(t_out), *extra]
        jax_env = dict(env)
        if dry_run:
            jax_env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
        else:
            jax_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        for part, cmd, path, part_env in (("torch", torch_cmd, t_out, env),
                                          ("jax", [sys.executable, __file__, "jax", "--out", str(j_out), *extra],
                                           j_out, jax_env)):
            try:
                rc = _run(cmd, part_env, timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            result[part] = json.loads(path.read_text()) if path.exists() else {
                "failures": [f"{part} part exited {rc} without results"]}
    out.write_text(json.dumps(result, indent=1))
    return result


def _summary(result: dict) -> str:
    lines = []
    for part in ("torch", "jax"):
        section = result.get(part)
        if section is None:
            continue
        cases = section.get("cases", [])
        lines.append(f"{part}: {len(cases)} cases, {len(section.get('failures', []))} failures")
        lines += [f"  FAIL {f.splitlines()[0]}" for f in section.get("failures", [])]
        for b in section.get("bench", []):
            if "crash" in b:
                lines.append(f"  bench {b.get('variant', b.get('impl'))}: crashed")
            elif part == "torch":
                ar = b["collectives_total"].get("all_reduce", {"count": 0, "bytes": 0})
                lines.append(f"  {b['variant']:<24} step {b['step_ms_median']:9.2f} ms   all_reduce {ar['count']:4d} "
                             f"({ar['bytes']} B)   all collectives "
                             f"{sum(e['count'] for e in b['collectives_total'].values())}")
            else:
                c = b["fwd_bwd_collectives"]
                lines.append(f"  {b['impl']:<8} weight {'trained' if b['weight_trained'] else 'frozen ':<7} "
                             f"fwd {b['fwd_ms_median']:8.3f} ms  fwd+bwd {b['fwd_bwd_ms_median']:8.3f} ms   "
                             f"all-reduce {c['all_reduce_ops']} ({c['all_reduce_bytes']} B), all-gather "
                             f"{c['all_gather']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", default="all", choices=("all", "torch", "jax"))
    parser.add_argument("--out", type=Path, required=True, help="where to write the results (JSON)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU: 2 gloo ranks and 2 host-platform JAX devices, tiny shapes (Triton's interpreter)")
    parser.add_argument("--skip-cases", action="store_true", help="only the benchmarks")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per part (all)")
    args = parser.parse_args(argv)
    if args.dry_run and args.part == "jax":  # before jax is imported: 2 CPU devices
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.part == "all":
        result = all_main(args.out, args.dry_run, args.skip_cases, args.timeout)
    elif args.part == "torch":
        result = {"torch": torch_main(args.out, args.dry_run, args.skip_cases)}
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        result = {"jax": jax_main(args.out, args.dry_run, args.skip_cases)}
    print(_summary(result), flush=True)
    return 1 if any(section.get("failures") for section in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
