# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Multi-device training: the collectives a frozen norm saves
#
# **Question.** When activations are sharded over devices, how many gradient all-reduces (and how many
# bytes) does a frozen norm weight save per step, in Torch and in JAX?
#
# **Answer** (the figure at the end): every trained norm parameter costs one all-reduce of its gradient
# per step; a frozen one costs none, and no activation is ever gathered. In the committed 2 × H200 run,
# freezing the norm weights of a sequence-parallel LoRA step in Torch removes one all-reduce per norm,
# and the sharded JAX RMSNorm's backward goes from one all-reduce to none; the live part of this
# notebook checks the same on a 2-device mesh wherever it runs.
#
# With the rows of x sharded over devices (data or sequence parallel), a norm's weight and bias are
# replicated and every device computes a *partial* dW/dB from its own rows. A trained parameter
# therefore costs one all-reduce of N elements per step (per norm); a frozen one costs none, because
# normkit does not compute dW/dB at all when they are not wanted (no partial buffer, no reduction,
# no collective). Activations never move: the op runs per device, so there is no all-gather.
#
# Two parts:
#
# 1. **Live, on any machine**: JAX on a 2-device mesh (on a CPU, two host devices forced with
#    `XLA_FLAGS=--xla_force_host_platform_device_count=2`). RMSNorm and LayerNorm on x of shape
#    (2, 8, 64), sharded on the sequence or the batch axis, with the weight (and bias) trained or
#    frozen. The jitted gradient is compiled and its HLO read: all-reduces, the bytes they deliver and
#    all-gathers are counted, and the gradients are checked against an unsharded run.
# 2. **Committed 2 × H200 results** (`benchmarks/results/multi_gpu_h200x2.json`, written by
#    `bash scripts/gpu-check.sh multi`): a sequence-parallel LoRA step of a small Llama in Torch,
#    normkit vs Hugging Face norms, frozen vs trained; and the JAX sharded RMSNorm timed with the
#    weight trained vs frozen.
#
# The usage pattern (`jax.make_mesh` with Auto or Explicit axes, `jax.set_mesh`, `NamedSharding`,
# `jax_frontend.freeze`) is the one of `docs/MULTI_GPU.md`. The live part runs once per kind of mesh
# axis in `MESH_KINDS` (below), and each kind gets its own rows in the figure.

# %%
import os

# Before jax is imported: on a CPU-only machine, pretend the host is two devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

# _nbutil first: it puts the repository on sys.path
from _nbutil import ROOT, Source, display, environment, footnote, notebook_size, show, table, this_run

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_frontend as jf
from tests.hlo import collectives

try:
    SIZE = notebook_size()
except ImportError:  # _nbutil asks torch whether CUDA is there; without torch, ask JAX
    SIZE = os.environ.get("NORMKIT_NOTEBOOK_SIZE") or ("full" if jax.default_backend() == "gpu" else "smoke")

devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")[:2]
devices = devices[:2]
assert len(devices) == 2, f"need 2 devices, found {jax.devices()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})"
# The kinds of mesh axis the live part compares: one mesh each, same devices, same axis name. Auto
# axes are the default of jax.sharding.Mesh, Flax partitioning rules and most training scripts: there
# normkit's ops tell XLA's partitioner how to shard them (custom_partitioning with a Shardy rule);
# Explicit axes carry the sharding in the type and normkit runs the op through shard_map.
MESH_KINDS = {"Auto": AxisType.Auto, "Explicit": AxisType.Explicit}
MESHES = {kind: jax.make_mesh((2,), ("sp",), axis_types=(axis_type,), devices=devices)
          for kind, axis_type in MESH_KINDS.items()}

SHAPE = (2, 8, 64)  # the live part is the same at every size: it counts collectives, it does not time
N = SHAPE[-1]
print(f"size: {SIZE}; x is {SHAPE}, float32; meshes {list(MESHES)} of shape {{'sp': 2}} on {[str(d) for d in devices]}")
display(table(list(environment().items()), ["component", "version or device"]))

# %% [markdown]
# ## Counting collectives in compiled HLO
#
# `tests.hlo.collectives` reads the compiled module's text. An all-reduce reads
# `%name = f32[64]{0} all-reduce(%operand), ...`; on a GPU it may be the asynchronous
# `all-reduce-start` (counted once), and its type may be a tuple: several arrays reduced at once, or for
# an async start `(operands, results)`. XLA's GPU combiner may also merge dW and dB into one
# instruction, so the check below counts the *bytes* reduced, not the arrays.

# %% [markdown]
# ## Live: trained vs frozen on a 2-device mesh
#
# The loss is `sum(norm(x, w, b) * g)` for a fixed random `g`; its gradient is taken with respect to
# the parameters and x. Freezing is `jax_frontend.freeze` inside the loss (a `jax.lax.stop_gradient`
# on the frozen leaves), so the jitted step is the same function with a static switch.

# %%
rng = np.random.default_rng(0)
x_np = rng.standard_normal(SHAPE).astype(np.float32)
g_np = rng.standard_normal(SHAPE).astype(np.float32)
params_np = {"weight": rng.uniform(0.5, 1.5, N).astype(np.float32),
             "bias": (0.1 * rng.standard_normal(N)).astype(np.float32)}

CASES = [  # op, sharded axis, parameters of the op, trained ones
    ("rms_norm", "sequence", ("weight",), ("weight",)),
    ("rms_norm", "sequence", ("weight",), ()),
    ("rms_norm", "batch", ("weight",), ("weight",)),
    ("rms_norm", "batch", ("weight",), ()),
    ("layer_norm", "batch", ("weight", "bias"), ("weight", "bias")),
    ("layer_norm", "batch", ("weight", "bias"), ("weight",)),  # bias frozen, weight trained
    ("layer_norm", "batch", ("weight", "bias"), ()),
    ("layer_norm", "sequence", ("weight", "bias"), ("weight", "bias")),
    ("layer_norm", "sequence", ("weight", "bias"), ()),
]
SPECS = {"sequence": P(None, "sp"), "batch": P("sp")}


def make_step(op_name, names, trained):
    def loss(params, x, g):
        p = jf.freeze(params, {n: n in trained for n in names})
        y = getattr(jf, op_name)(x, *(p[n] for n in names))
        return jnp.sum(y * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


rows = []
for (op_name, axis, names, trained), (kind, mesh) in [(case, m) for case in CASES for m in MESHES.items()]:
    step = make_step(op_name, names, trained)
    params = {n: jnp.asarray(params_np[n]) for n in names}
    ref_dp, ref_dx = step(params, jnp.asarray(x_np), jnp.asarray(g_np))  # unsharded, one device
    with jax.set_mesh(mesh):
        rows_sh = NamedSharding(mesh, SPECS[axis])
        x = jax.device_put(x_np, rows_sh)
        g = jax.device_put(g_np, rows_sh)
        p_sh = {n: jax.device_put(params_np[n], NamedSharding(mesh, P())) for n in names}  # replicated
        dp, dx = step(p_sh, x, g)
        hlo = step.lower(p_sh, x, g).compile().as_text()
    c = collectives(hlo)
    # Same gradients as unsharded (fp32: dW/dB are sums over 16 rows, reduced in another order).
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ref_dx), rtol=1e-5, atol=1e-5)
    for n in names:
        np.testing.assert_allclose(np.asarray(dp[n]), np.asarray(ref_dp[n]), rtol=1e-5, atol=1e-5)
        if n not in trained:
            assert not np.any(np.asarray(dp[n])), f"{op_name}: frozen {n} has a nonzero gradient"
    # The claims: no activation moves; exactly the trained parameters' gradients are all-reduced.
    what = (kind, op_name, axis, trained, c)
    assert c["all_gather"] == c["all_to_all"] == 0, what
    if not trained:
        assert c["all_reduce_ops"] == 0, what
    else:
        assert c["all_reduce_ops"] >= 1 and c["all_reduce_bytes"] == 4 * N * len(trained), what
    spec = list(dx.sharding.spec)
    assert spec + [None] * (3 - len(spec)) == list(SPECS[axis]) + [None] * (3 - len(SPECS[axis])), dx.sharding
    rows.append({"mesh": kind, "op": op_name, "x sharded on": axis,
                 "trained params": ", ".join(trained) or "none (frozen)",
                 "norm params": "trained" if set(trained) == set(names) else "frozen" if not trained else "partly",
                 "all-reduces per step": c["all_reduce_ops"], "bytes all-reduced per step (B)": c["all_reduce_bytes"],
                 "all-gathers per step": c["all_gather"], "dx spec": str(dx.sharding.spec)})
    if c["all_reduce_lines"]:
        print(f"{kind} mesh, {op_name} {axis} trained={list(trained)}:",
              *(line[:140] for line in c["all_reduce_lines"]), sep="\n    ")

LIVE = table(rows)
display(LIVE)
print("checked: frozen -> 0 all-reduces; trained -> 4*N bytes per trained parameter; no all-gather; "
      "gradients equal the unsharded run")

# %% [markdown]
# Per step and per norm, a trained weight costs one all-reduce of `4 N` bytes (fp32 gradients here;
# the committed bf16 runs below reduce `2 N`), a trained weight and bias `8 N` — in one or two
# instructions, as XLA combines them. Frozen, the backward has no collective at all: dx stays
# sharded like x and the parameters get a symbolic-zero cotangent.
#
# ## Committed: 2 × H200
#
# `bash scripts/gpu-check.sh multi` on a machine with two GPUs runs the multi-device test cases of
# Torch and JAX and a small benchmark of each, and writes `benchmarks/results/multi_gpu_h200x2.json`.
#
# **Torch**: one LoRA training step of a small Llama (`scripts/multi_gpu.py`: 4 layers, hidden size
# 2048, so 9 RMSNorms of 2048 weights) with sequence parallelism over 2 GPUs
# (`parallelize_module` with `SequenceParallel` on the norms), normkit's norms vs Hugging Face's
# `LlamaRMSNorm`, with the norm weights frozen or trained. Collectives are counted per step, by kind.

# %%
RESULTS = Path(os.environ.get("NORMKIT_MULTI_GPU_RESULTS", ROOT / "benchmarks" / "results" / "multi_gpu_h200x2.json"))
results = json.loads(RESULTS.read_text()) if RESULTS.exists() else None
if results is None:
    SOURCE_NOTE = ""
    print(f"{RESULTS.relative_to(ROOT) if RESULTS.is_relative_to(ROOT) else RESULTS} is absent: produce it with "
          "`bash scripts/gpu-check.sh multi` on a machine with 2 GPUs, then rebuild this notebook "
          "(python notebooks/build.py 05).")
else:
    SOURCE_NOTE = "Committed results: " + Source.of(RESULTS, results).label()
    print(SOURCE_NOTE)
    for k, v in results.get("provenance", {}).items():
        print(f"  {k}: {v}")
torch_res = (results or {}).get("torch") or {}
jax_res = (results or {}).get("jax") or {}


def _count(coll: dict, kind: str, what: str = "count"):
    return (coll or {}).get(kind, {}).get(what, 0)


torch_rows = []
for b in torch_res.get("bench", []):
    total = b.get("collectives_total", {})
    torch_rows.append({
        "norms": b.get("impl"), "norm weights": "trained" if b.get("norms_trained") else "frozen",
        "step (ms, median)": b.get("step_ms_median"),
        "all-reduces per step": _count(total, "all_reduce"),
        "bytes all-reduced per step (B)": _count(total, "all_reduce", "bytes"),
        "collectives per step": sum(v.get("count", 0) for v in total.values()),
        "by kind (count)": ", ".join(f"{k} {v.get('count', 0)}" for k, v in sorted(total.items())),
        "norm params (elements)": b.get("norm_params"), "loss (nats)": b.get("loss"),
    })
if torch_rows:
    env = torch_res.get("env", {})
    print(f"torch {env.get('torch')} on {env.get('world_size')} x {env.get('device_name')}; "
          f"failed test cases: {len(torch_res.get('failures', []))} of {len(torch_res.get('cases', []))}")
    display(table(torch_rows))
    by = {(r["norms"], r["norm weights"]): r for r in torch_rows}
    for impl in ("normkit", "hf"):
        fr, tr = by.get((impl, "frozen")), by.get((impl, "trained"))
        if fr and tr:
            print(f"{impl}: norm weights frozen -> {fr['all-reduces per step']} all-reduces per step "
                  f"({fr['bytes all-reduced per step (B)']:,} B), trained -> {tr['all-reduces per step']} "
                  f"({tr['bytes all-reduced per step (B)']:,} B), {tr['all-reduces per step'] - fr['all-reduces per step']} "
                  f"saved; step {fr['step (ms, median)']:.1f} ms vs {tr['step (ms, median)']:.1f} ms")
elif results is not None:
    print("no torch bench rows in", RESULTS.name)

# %% [markdown]
# **JAX**: `jax_frontend.rms_norm` on x sharded over the sequence axis of 2 GPUs (bf16) on an Explicit
# mesh, forward and forward + backward timed, with the weight trained or frozen; normkit's kernels and
# plain XLA.

# %%
jax_rows = []
for b in jax_res.get("bench", []):
    fb = b.get("fwd_bwd_collectives", {})
    jax_rows.append({
        "impl": b.get("impl"), "weight": "trained" if b.get("weight_trained") else "frozen",
        "shape": "x".join(str(d) for d in b.get("shape", [])), "dtype": b.get("dtype"), "x spec": b.get("spec"),
        "fwd (ms)": b.get("fwd_ms_median"), "fwd+bwd (ms)": b.get("fwd_bwd_ms_median"),
        "all-reduces per step": fb.get("all_reduce_ops"), "bytes all-reduced per step (B)": fb.get("all_reduce_bytes"),
        "all-gathers per step": fb.get("all_gather", 0) + b.get("fwd_collectives", {}).get("all_gather", 0),
    })
if jax_rows:
    env = jax_res.get("env", {})
    print(f"jax {env.get('jax')} on {env.get('devices')}; "
          f"failed test cases: {len(jax_res.get('failures', []))} of {len(jax_res.get('cases', []))}")
    display(table(jax_rows))
    by = {(r["impl"], r["weight"]): r for r in jax_rows}
    fr, tr = by.get(("normkit", "frozen")), by.get(("normkit", "trained"))
    if fr and tr:
        print(f"normkit: weight frozen -> {fr['all-reduces per step']} all-reduce ({fr['bytes all-reduced per step (B)']} B), "
              f"trained -> {tr['all-reduces per step']} ({tr['bytes all-reduced per step (B)']} B); "
              f"fwd+bwd {fr['fwd+bwd (ms)']:.3f} ms vs {tr['fwd+bwd (ms)']:.3f} ms")
elif results is not None:
    print("no jax bench rows in", RESULTS.name)

# %% [markdown]
# ## The answer: all-reduces and bytes per step, trained against frozen
#
# One row per setup, trained (red) against frozen (blue) norm parameters: the committed 2 × H200 runs
# (Torch's sequence-parallel LoRA step with normkit's or Hugging Face's norms; the sharded JAX RMSNorm),
# and this run's live cases, one row per kind of mesh axis in `MESH_KINDS`. Counts and bytes come from
# the collectives themselves (Torch's `CommDebugMode`, XLA's compiled HLO), not from timings, so the live
# rows mean the same on a CPU as on a GPU.

# %%
FIGURE_ROWS = []  # one pair (trained, frozen) per setup: label, counts and bytes
for impl, name in (("normkit", "normkit norms"), ("hf", "HF norms")):
    pair = {w: next((r for r in torch_rows if (r["norms"], r["norm weights"]) == (impl, w)), None)
            for w in ("trained", "frozen")}
    if all(pair.values()):
        FIGURE_ROWS.append({"setup": f"torch · SP LoRA step, {name}\n(2 x H200, committed)",
                            **{f"{w} {k}": pair[w][f"{k}"] for w in pair
                               for k in ("all-reduces per step", "bytes all-reduced per step (B)")}})
for impl in ("normkit", "xla"):
    pair = {w: next((r for r in jax_rows if (r["impl"], r["weight"]) == (impl, w)), None) for w in ("trained", "frozen")}
    if all(pair.values()):
        FIGURE_ROWS.append({"setup": f"JAX · rms_norm {pair['trained']['shape']}, {impl}, Explicit mesh\n"
                                     "(2 x H200, committed)",
                            **{f"{w} {k}": pair[w][k] for w in pair
                               for k in ("all-reduces per step", "bytes all-reduced per step (B)")}})
for (kind, op_name, axis), g in LIVE.groupby(["mesh", "op", "x sharded on"], sort=False):
    pair = {w: g[g["norm params"] == w] for w in ("trained", "frozen")}
    if all(len(v) for v in pair.values()):
        FIGURE_ROWS.append({"setup": f"JAX · {op_name} {'x'.join(map(str, SHAPE))}, {axis}-sharded, {kind} mesh\n"
                                     f"(this run, {devices[0].platform})",
                            **{f"{w} {k}": int(pair[w][k].iloc[0]) for w in pair
                               for k in ("all-reduces per step", "bytes all-reduced per step (B)")}})
FIGURE = table(FIGURE_ROWS)

fig, (ax_n, ax_b) = plt.subplots(1, 2, figsize=(14, 0.62 * len(FIGURE_ROWS) + 1.6), sharey=True)
ys = np.arange(len(FIGURE_ROWS))[::-1]
for ax, what, xlabel in ((ax_n, "all-reduces per step", "all-reduces per step (count)"),
                         (ax_b, "bytes all-reduced per step (B)", "bytes all-reduced per step (B, log scale)")):
    for k, (w, color) in enumerate((("trained", "tab:red"), ("frozen", "tab:blue"))):
        vals = FIGURE[f"{w} {what}"].to_numpy(dtype=float)
        bars = ax.barh(ys + (0.2 if w == "trained" else -0.2), vals, 0.4, color=color, label=f"norm params {w}")
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:,.0f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3, axis="x")
ax_b.set_xscale("symlog", linthresh=100)
ax_b.set_xlim(0, FIGURE[[c for c in FIGURE if "bytes" in c]].to_numpy().max() * 20)
ax_n.set_xlim(0, FIGURE[[c for c in FIGURE if "all-reduces" in c]].to_numpy().max() * 1.25)
ax_n.set_yticks(ys, FIGURE["setup"], fontsize=8)
ax_n.legend(fontsize=8, loc="lower right")
fig.suptitle("Gradient all-reduces per step with the norm parameters trained or frozen (rows of x sharded)")
fig.tight_layout()
live = this_run(SIZE, "live rows: HLO compiled in this run", on=f"2 {devices[0].platform} devices")
footnote(fig, (SOURCE_NOTE + "\n" if SOURCE_NOTE else "") + live
         + ".\nCounts and bytes are read from the compiled collectives; they say nothing about speed.")
show(fig)
display(FIGURE)

# %% [markdown]
# What the numbers show: in the committed run, freezing the norm weights takes the Torch
# sequence-parallel step from 20 all-reduces to 11 (9 fewer: one per norm's weight gradient, the same
# with normkit's or Hugging Face's norms: the saving is in the parallel plan, not the kernel), and the
# JAX sharded RMSNorm's backward from 1 all-reduce to 0. The bytes saved are small (N elements per
# norm), but each all-reduce is a synchronisation point on the step's critical path; the lines printed
# above are computed from the results file itself.
