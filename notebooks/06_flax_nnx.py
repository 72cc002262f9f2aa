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
# # 06 · Flax NNX: normkit's norms in an NNX model, LoRA by filter
#
# **Question.** Can a Flax NNX model take normkit's norms without a change to its code, and when only
# the LoRA adapters train (`nnx.grad(..., argnums=nnx.DiffState(0, nnx.LoRAParam))`), does the norms'
# backward then skip its dW work, with no `freeze` call?
#
# **Answer.** `jax_frontend.nnx.patch_model(model)` turns every `nnx.RMSNorm` of a Llama-style NNX
# model into normkit's, in place: the same module objects and `nnx.Param` objects, the same state. At
# every training step below, the patched model's loss and LoRA gradients agree with flax's
# `nnx.RMSNorm` on the same parameters within the tolerance table (`normkit.testing`), and the norms'
# backward launches have `COMPUTE_DW` off: no fp32 partial buffer, no reduction launch. Training the
# norms too (`DiffState(0, nnx.Param)`) brings dW, its partial buffers and its reductions back. On the
# H200 (`benchmarks/nnx_lora_step.py`, its committed results at the end), the jitted LoRA step takes
# flax's time (58.81 against 58.82 ms, where flax's own second copy ran 60.38), and its compiled
# temporaries are 192 MiB (4.1%) smaller: the frozen norms keep their output rather than their input
# (with `save="input"` the temporaries equal flax's).
#
# The model is the benchmark's (`benchmarks/nnx_lora_step.py`, `Llama`): embedding, pre-norm decoder
# layers (`nnx.RMSNorm`, causal attention with `nnx.LoRALinear` on q/k/v/o, a SwiGLU MLP), a final
# `nnx.RMSNorm` and an LM head. normkit's NNX modules subclass flax's (`jax_frontend.nnx.RMSNorm` is an
# `nnx.RMSNorm` with another `__call__`), so patching gives each module object normkit's class and
# changes nothing else; `docs/NNX.md` has the details.

# %%
import glob
import os

import matplotlib.pyplot as plt
import numpy as np

# _nbutil first: it puts the repository on sys.path
from _nbutil import RESULTS_DIR, Source, display, environment, footnote, notebook_size, show, table, this_run

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_frontend as jf
import normkit
from benchmarks import nnx_lora_step as bench
from jax_frontend import nnx as nknnx
from normkit.testing import assert_close

try:
    SIZE = notebook_size()
except ImportError:  # _nbutil asks torch whether CUDA is there; without torch, ask JAX
    SIZE = os.environ.get("NORMKIT_NOTEBOOK_SIZE") or ("full" if jax.default_backend() == "gpu" else "smoke")

# float32 throughout, so that the comparison uses the tolerance table's float32 row.
CFG = {"smoke": bench.SMOKE,
       "full": bench.Config(layers=2, hidden=1024, intermediate=2816, heads=8, vocab=4096, seq=256, batch=4, rank=8,
                            dtype="fp32")}[SIZE]
STEPS = {"smoke": 3, "full": 10}[SIZE]
jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on a GPU: the models differ in their norms only
print(f"size: {SIZE}; {CFG}; {STEPS} steps; normkit implementation {jf.resolve_implementation()!r}")
display(table(list(environment().items()), ["component", "version or device"]))

# %% [markdown]
# ## Patching
#
# Two copies of one random model: `flax_model` keeps flax's `nnx.RMSNorm`, `model` is patched. The
# report lists what was patched (and what was skipped, with the reason); the parameters are the same
# objects before and after, so the state, its paths and any sharding metadata are unchanged.

# %%
base = bench.build(CFG, seed=0)
flax_model, _ = bench.variant(base, "flax")
model, _ = bench.variant(base, "flax")
params_before = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
state_before = nnx.state(model)
report = nknnx.patch_model(model)
print(report)
assert {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)} == params_before
assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state_before)
assert len(report) == 2 * CFG.layers + 1 and not report.skipped
modules = {".".join(map(str, path)): m for path, m in nnx.iter_modules(model)}
display(table([{"path": path, "was": f"flax.nnx.{old.__name__}", "now": f"jax_frontend.nnx.{new.__name__}",
                "epsilon": modules[path].epsilon, "scale dtype": modules[path].scale.get_value().dtype.name,
                "casting_mode": modules[path].casting_mode, "offset": modules[path].offset}
               for path, old, new in report.patched]))

# %% [markdown]
# ## LoRA training, normkit against `nnx.RMSNorm`
#
# The training step is plain NNX: gradients of the LoRA parameters only (`DiffState(0, nnx.LoRAParam)`),
# AdamW over them (`nnx.Optimizer(..., wrt=nnx.LoRAParam)`), under `nnx.jit`. The patched model trains;
# before each of its steps, `flax_model` is given the same parameters (`nnx.update`) and computes the
# loss and LoRA gradients with flax's norms, so that every step compares the two on the same point.
# Both must agree within the tolerance table's float32 row (LoRA gradients: sums over the batch's
# tokens, so their tolerance grows with the square root of the token count). The launches are recorded
# when the step is traced (its first call).

# %%
batches = [jax.random.randint(k, (CFG.batch, CFG.seq), 0, CFG.vocab)
           for k in jax.random.split(jax.random.key(1), STEPS)]
optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.LoRAParam)


@nnx.jit
def train_step(model, optimizer, ids):
    loss, grads = bench.lora_grads(model, ids)
    optimizer.update(model, grads)
    return loss, grads


flax_grads = nnx.jit(bench.lora_grads)
TOKENS = CFG.batch * (CFG.seq - 1)


def leaves(grads) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(g, np.float64)
            for p, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]}


rows = []
with normkit.record_launches() as lora_log:
    for i, ids in enumerate(batches):
        nnx.update(flax_model, nnx.state(model))  # the same parameters
        want_loss, want = flax_grads(flax_model, ids)
        loss, grads = train_step(model, optimizer, ids)
        got, want = leaves(grads), leaves(want)
        assert_close(float(loss), float(want_loss), "float32", f"step {i} loss")
        for name, g in want.items():
            assert_close(got[name], g, "float32", f"step {i} {name}", reduced_over=TOKENS)
        rel = {name: np.linalg.norm(got[name] - g) / np.linalg.norm(g) for name, g in want.items()}
        rows.append({"step": i, "loss (normkit)": float(loss), "loss (flax)": float(want_loss),
                     "|Δloss|": abs(float(loss) - float(want_loss)), "LoRA leaves": len(rel),
                     "max relative L2 difference of a LoRA gradient": max(rel.values()),
                     "median": float(np.median(list(rel.values())))})
STEPS_TABLE = table(rows)

fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(12, 3.8))
ax_l.plot(STEPS_TABLE["step"], STEPS_TABLE["loss (flax)"], "o-", lw=3, alpha=0.4, label="flax nnx.RMSNorm")
ax_l.plot(STEPS_TABLE["step"], STEPS_TABLE["loss (normkit)"], "x--", color="black", label="normkit (patched)")
ax_l.set(xlabel="step", ylabel="loss (nats)", title="training loss, same parameters each step")
ax_l.legend()
ax_g.semilogy(STEPS_TABLE["step"], STEPS_TABLE["max relative L2 difference of a LoRA gradient"], "o-",
              label="max over leaves")
ax_g.semilogy(STEPS_TABLE["step"], STEPS_TABLE["median"], "s--", label="median over leaves")
ax_g.set(xlabel="step", ylabel="‖g_normkit − g_flax‖ / ‖g_flax‖",
         title="LoRA gradients: normkit against flax (float32)")
ax_g.legend()
ax_g.grid(alpha=0.3, which="both")
fig.suptitle(f"LoRA steps of a {CFG.layers}-layer NNX Llama (hidden {CFG.hidden}): normkit's RMSNorm vs flax's")
fig.tight_layout()
footnote(fig, this_run(SIZE, "trained in this run", on=jax.devices()[0].device_kind))
show(fig)
display(STEPS_TABLE)
print(f"{STEPS} steps: every loss and LoRA gradient within the float32 tolerances of normkit.testing")

# %% [markdown]
# ## What the norms' backward launched
#
# The LoRA step's launches (recorded as it was traced), against the same model trained whole
# (`nnx.grad` of every `nnx.Param`: the norms' scale is differentiated too). With the LoRA filter, the
# norms' backward has `COMPUTE_DW` off and allocates no partial buffer, and no reduction runs; the
# first layer's input norm reads the embedding, which does not train, so its forward stores no
# statistics (`STORE_STATS` off) and it needs no backward at all. Under `jit` a launch is recorded when
# the computation is lowered, and JAX lowers identical calls (same shapes, same flags) once: the rows
# are the distinct kernel variants of the step, not one per norm.

# %%
with normkit.record_launches() as full_log:
    nnx.jit(nnx.grad(bench.loss_fn))(model, batches[0])


def launch_rows(log, what):
    return [{"step": what, "kernel": launch.kernel, "implementation": launch.implementation,
             "N": launch.flags.get("N"), "STORE_STATS": launch.flags.get("STORE_STATS"),
             "COMPUTE_DX": launch.flags.get("COMPUTE_DX"),
             "COMPUTE_DW": launch.flags.get("COMPUTE_DW"), "partial buffers (B)": launch.partial_bytes}
            for launch in log]


LAUNCHES = table(launch_rows(lora_log, "LoRA filter") + launch_rows(full_log, "everything trained"))
display(LAUNCHES)
bwd = lambda log: [launch for launch in log if launch.kernel in ("norm_bwd_kernel", "xla_norm_bwd")]  # noqa: E731
assert bwd(lora_log) and not any(b.flags["COMPUTE_DW"] for b in bwd(lora_log))
assert not any(launch.partial_buffers for launch in lora_log) and not lora_log.of("partial_sum_kernel")
assert bwd(full_log) and all(b.flags["COMPUTE_DW"] for b in bwd(full_log))
print(f"LoRA filter: {len(bwd(lora_log))} norm backward launches, none with dW, 0 B of partials; everything "
      f"trained: {len(bwd(full_log))} with dW, {sum(launch.partial_bytes for launch in full_log):,} B of partials, "
      f"{len(full_log.of('partial_sum_kernel'))} reduction launches")

# %% [markdown]
# ## The H200 step: `benchmarks/nnx_lora_step.py`
#
# The benchmark times the same kind of step at the size of the Torch LoRA benchmark (4 layers × 4096,
# 8192 tokens, bf16), jitted over the split state, with flax's norms (XLA) and normkit's, in interleaved
# rounds, and records the compiled step's `memory_analysis()`. Its results are shown here when a file
# `benchmarks/results/nnx_lora_step_<device>.json` is committed.

# %%
found = sorted(p for p in glob.glob(str(RESULTS_DIR / "nnx_lora_step_*.json")) if not p.endswith("_smoke.json"))
if not found:
    print("No committed results (benchmarks/results/nnx_lora_step_<device>.json): run "
          "`python3 benchmarks/nnx_lora_step.py` on the GPU machine, commit its JSON and Markdown, and rebuild "
          "this notebook (python notebooks/build.py 06). Skipped.")
else:
    import json
    from pathlib import Path

    for path in found:
        doc = json.loads(Path(path).read_text())
        source = Source.of(path, doc)
        print(source.label())
        display(table(bench.table_rows(doc["rows"])))
        ok = [r for r in doc["rows"] if r.get("step_ms")]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.4))
        names = [r["variant"] for r in ok]
        colors = ["tab:gray" if n.startswith("flax") else "tab:blue" for n in names]
        ax_t.bar(names, [r["step_ms"]["median"] for r in ok], color=colors)
        ax_t.set(ylabel="median step (ms)", title="LoRA step time")
        ax_m.bar(names, [(r.get("memory_bytes") or {}).get("temp", 0) / 2**30 for r in ok], color="tab:green")
        ax_m.set(ylabel="temporaries (GiB)", title="compiled step: memory_analysis()")
        fig.tight_layout()
        footnote(fig, source.label())
        show(fig)
