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
# # 03 · LoRA fine-tuning with normkit norms
#
# **Question.** What happens when normkit's norms go into a LoRA fine-tune that already runs: do the
# losses and gradients stay as accurate as with the model's own norms, and what does it do to the step
# time and memory?
#
# **Answer.** On the H200 (the first figures, from the committed LoRA-step benchmarks) normkit's norms
# give the fastest eager step of the three in every configuration; compiled, a step from 0.1% faster
# to 2.3% slower than Hugging Face's (Inductor generates a frozen norm in both). They also hold less memory: with the
# adapters in the model's dtype, a frozen norm keeps its output for the backward, which the adapter
# keeps anyway, instead of its input. With LoRA on every linear of a 16 x 2048 Llama at 8192 tokens the
# step peaks at 11.38 GiB against Hugging Face's 13.35 eager (0.85x; Liger and normkit keeping the
# input: 12.35) and 8.70 against 9.67 compiled (0.90x); with LoRA on q/k/v/o, 0.90x eager and 0.95x
# compiled. PEFT's default float32 adapters each keep their own float32 copy of the norm's output;
# there `patch_model` has the norm write one copy that every adapter takes and the frozen norm keeps:
# 0.748x Hugging Face's step peak on every linear and 0.809x on q/k/v/o, eager. On a Qwen3 step the
# fused QK-norm + RoPE takes the eager step to 0.88x the time and 0.927x the memory of normkit's plain
# patch (0.63x and 0.763x Hugging Face's). The printed lines under the figures give every run's numbers. In this run's training (later figures), the patched model's losses and LoRA
# gradients are as close to a float64 run as the unpatched model's, and the frozen norm weights get
# no gradient.
#
# A fine-tuner's view of the frozen-parameter backward: drop normkit into a model that is already
# being trained, without touching its code.
#
# - **Torch**: a small `LlamaForCausalLM` built from a config (random init, nothing downloaded), wrapped
#   in a PEFT LoRA adapter, then `torch_frontend.patch_model(model)`. A few AdamW steps on synthetic
#   tokens; at every step the patched model's loss and LoRA gradients must be as accurate as the
#   unpatched model's (both in float32, measured against the same step in float64), the (frozen) norm
#   weights must get no gradient, and the launch record must show the dW-free backward.
# - **JAX**: the same idea on a small transformer block in plain JAX, with `jax_frontend.freeze` masks
#   and optax; its losses must match a pure-`jnp` reference model.
#
# Sizes follow `NORMKIT_NOTEBOOK_SIZE` (`smoke` on CPU, where Triton runs in its interpreter; `full` on a GPU).

# %%
import copy
import json
import time
import types
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

# _nbutil first: it puts the repository on sys.path
from _nbutil import RESULTS_DIR, Source, display, environment, footnote, grouped_bars, notebook_size, show, table, this_run

import normkit
import torch_frontend as tf

SIZE = notebook_size()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CFG = {
    "smoke": dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab=96, seq=16, batch=2, steps=4),
    "full": dict(hidden=512, layers=4, heads=8, kv_heads=4, vocab=1024, seq=128, batch=8, steps=12),
}[SIZE]
print(f"size: {SIZE}", CFG)
display(table(list(environment().items()), ["component", "version or device"]))

# %% [markdown]
# ## The answer on the H200: step time and memory of a LoRA step
#
# From the committed LoRA-step benchmarks (`benchmarks/lora_step.py`, results
# `benchmarks/results/lora_step_*.json`): a random-init Llama in bf16 with PEFT LoRA (r = 16) on the
# attention projections (q/k/v/o) or on every linear, the norm weights frozen, AdamW on the adapters.
# Each variant changes only the norms: Hugging Face's `LlamaRMSNorm` (`hf`), Liger's `LigerRMSNorm`
# (`liger`), `torch_frontend.patch_model` (`normkit`, which keeps the norm's output for the backward
# where every parameter is frozen), the same with `save="input"` (`normkit_input`, which keeps the
# input as every other library does), with the residual add fused into the norm (`normkit_fused`) and
# without the adapters' shared copy (`normkit_apart`, below); eager and under `torch.compile`. `hf#2`, where a run has it, is a second, independently built copy of
# the HF model timed beside the others: its distance to `hf` is what that run cannot resolve. Step time
# is the median of the timed steps. Nothing here is measured where the notebook runs.
#
# **Memory** is each variant's own step peak: the largest allocation during its timed steps above what
# was allocated when they began (the models and optimizer states). Runs before that measure existed
# recorded one peak over variants that had already run and are left out of the memory figure. Keeping
# the output frees the norm's input only where something else keeps the output anyway: a LoRA adapter
# whose input is the norm's output keeps it when the adapter computes in the model's dtype (`bf16
# adapters`, PEFT's `autocast_adapter_dtype=False`). PEFT's default gives a bf16 model float32 adapters,
# each of which converts its input and keeps that float32 copy: q, k and v three copies of one norm
# output. There `patch_model` has the norm write the float32 copy once, every adapter take it, and the
# frozen norm keep that copy as its own saved output (`fp32 adapters`, `normkit`); `normkit_apart`
# (`share_adapter_copy=False`) is the same patch without it, where keeping y costs what keeping x did.

# %%
VARIANT_COLORS = {"hf": "tab:orange", "hf#2": "navajowhite", "liger": "tab:blue", "normkit_input": "silver",
                  "normkit_apart": "tab:olive", "normkit": "black", "normkit_fused": "tab:gray"}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def run_label(cfg: dict, mode: str, source: Source) -> str:
    """A short label of a run's model, LoRA, mode and commit (one group of bars per run: variants are
    compared only within one), e.g. '16x2048 all linear, 8192x1\\nbf16 adapters, compiled, 519f690'."""
    lora = cfg.get("lora") or {}
    targets = "q/k/v/o" if lora.get("targets", ATTENTION) == ATTENTION else "all linear"
    adapters = {"model": f"{cfg['dtype']} adapters", "float32": "fp32 adapters"}.get(lora.get("adapter_dtype"),
                                                                                   "fp32 adapters")
    return (f"{cfg['layers']}x{cfg['hidden']} {targets}, {cfg['seq']}x{cfg['batch']}\n{adapters}, {mode}, "
            f"{(source.commit or 'no commit')[:7]}")


lora_files = sorted(RESULTS_DIR.glob("lora_step_*.json"))
step_rows, lora_sources = [], []
for path in lora_files:
    doc = json.loads(path.read_text())
    cfg = doc["config"]
    if cfg.get("arch", "llama") != "llama":  # Qwen3, Gemma 3: the fused QK-norm + RoPE section below
        continue
    source = Source.of(path, doc)
    lora_sources.append(source)
    for r in doc["rows"]:
        if r.get("status") != "ok":
            continue
        mode = {"compile": "compiled"}.get(r["mode"], r["mode"])
        step_rows.append({"run": run_label(cfg, mode, source), "file": path.stem.removeprefix("lora_step_"),
                          "variant": r["variant"], "step (ms)": r["step_ms"]["median"],
                          "step min (ms)": r["step_ms"]["min"], "step max (ms)": r["step_ms"]["max"],
                          # each variant's own peak; older files have none (one peak over several variants)
                          "step memory (GiB)": r.get("step_peak_gb"),
                          # 0 ms "by kernel name": no normkit kernel ran (Inductor generated the frozen norm)
                          "norm kernels (ms per step)": r.get("norm_ms") or None,
                          "loss Δ vs hf eager": r.get("loss_diff_vs_hf"), "timed steps": r.get("steps")})
# two files of one commit, model and mode are two runs: number the second, so that no group mixes runs
labels: dict = {}
for r in step_rows:
    taken = [f for (label, f) in labels if label == r["run"]]
    if r["file"] not in taken:
        labels[r["run"], r["file"]] = r["run"] + (f" ({len(taken) + 1})" if taken else "")
    r["run"] = labels[r["run"], r["file"]]
STEPS = table(step_rows)


def bars(rows: list[dict], column: str, ylabel: str, title: str, fmt: str, ax) -> None:
    groups = list(dict.fromkeys(r["run"] for r in rows))
    variants = [v for v in VARIANT_COLORS if any(r["variant"] == v for r in rows)]
    at = {(r["run"], r["variant"]): r[column] for r in rows}
    grouped_bars(ax, groups, {v: [at.get((g, v)) for g in groups] for v in variants}, colors=VARIANT_COLORS,
                 annotate=fmt)
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(title="norms", fontsize=7, ncol=3, loc="upper left")


if step_rows:
    devices = ", ".join(dict.fromkeys(s.device or "an unrecorded device" for s in lora_sources))
    sources = "Committed results:\n" + "\n".join(s.label() for s in lora_sources)
    memory_rows = [r for r in step_rows if r["step memory (GiB)"] is not None]
    if memory_rows:
        fig, ax = plt.subplots(figsize=(12, 6))
        bars(memory_rows, "step memory (GiB)", "step peak above the models (GiB)",
             "Memory of a LoRA step (lower is better)", "{:.2f}", ax)
        fig.suptitle(f"LoRA training step on the {devices}: what the norms' saved tensors cost (Llama, bf16)")
        fig.tight_layout()
        footnote(fig, sources)
        show(fig)
        for run, g in STEPS[STEPS["step memory (GiB)"].notna()].groupby("run", sort=False):
            mem = dict(zip(g["variant"], g["step memory (GiB)"]))
            if {"hf", "normkit"} <= mem.keys():
                others = ", ".join(f"{v} {m:.2f}" for v, m in mem.items() if v not in ("hf", "normkit"))
                print(f"{run.replace(chr(10), ', ')}: normkit {mem['normkit']:.2f} GiB = "
                      f"{mem['normkit'] / mem['hf']:.3f} x hf's {mem['hf']:.2f}" + (f" ({others})" if others else ""))
    fig, ax = plt.subplots(figsize=(14, 6))
    bars(step_rows, "step (ms)", "median step time (ms)", "Step time of a LoRA step (lower is better)", "{:.1f}", ax)
    fig.suptitle(f"LoRA training step on the {devices}: Hugging Face, Liger and normkit norms (Llama, bf16)")
    fig.tight_layout()
    footnote(fig, sources)
    show(fig)
    display(STEPS.round(3))
    for run, g in STEPS.groupby("run", sort=False):
        ms = dict(zip(g["variant"], g["step (ms)"]))
        ranked = ", ".join(f"{v} {t:.1f} ms" for v, t in sorted(ms.items(), key=lambda kv: kv[1]))
        against = f"; normkit against hf: {100 * (ms['normkit'] / ms['hf'] - 1):+.1f}%" if {"hf", "normkit"} <= ms.keys() else ""
        control = f", hf#2 against hf: {100 * (ms['hf#2'] / ms['hf'] - 1):+.1f}%" if {"hf", "hf#2"} <= ms.keys() else ""
        print(f"{run.replace(chr(10), ', ')}: {ranked}{against}{control}")
else:
    print("No LoRA-step results are committed (benchmarks/results/lora_step_*.json): run "
          "`bash scripts/gpu-check.sh lora` on the GPU machine and commit its JSON to draw these figures.")

# %% [markdown]
# ## Qwen3: the fused QK-norm + RoPE
#
# Qwen3 (like Qwen3-MoE and Gemma 3) normalizes each attention head's query and key (QK-norm, rows of
# head_dim = 128) and then rotates them (RoPE). `patch_model` fuses the pair into one op,
# `torch_frontend.rms_norm_rope` (`qk_norm_rope=True`, the default): with the norm's weight frozen it
# keeps for the backward only its rotated output, which attention keeps anyway, and recovers the
# normalized input through the inverse rotation; it reads attention's [B, H, S, D] gradient in place.
# `normkit` here is `patch_model(model, qk_norm_rope=False)`: the norms alone, each keeping its normalized
# output. The runs: a random-init Qwen3, 16 layers x 2048 hidden (16 query and 8 key/value heads of
# 128), 2 x 4096 tokens, bf16, LoRA r = 16 on q/k/v/o with adapters in the model's dtype. With an
# attention mask, transformers' SDPA path copies k and v for the grouped heads (`repeat_kv`), so the
# rotated k is kept once more and the saving shrinks. Nothing here is measured where the notebook runs.

# %%
VARIANT_COLORS["normkit_rope"] = "tab:purple"
qwen_rows, qwen_sources = [], []
for path in lora_files:
    doc = json.loads(path.read_text())
    cfg = doc["config"]
    if cfg.get("arch", "llama") == "llama":
        continue
    source = Source.of(path, doc)
    qwen_sources.append(source)
    run = (f"{ {'qwen3': 'Qwen3', 'gemma3': 'Gemma 3'}.get(cfg['arch'], cfg['arch'])} {cfg['layers']}x{cfg['hidden']}, {cfg['seq']}x{cfg['batch']}"
           f"{', masked' if cfg.get('mask') else ''}\n{{}}, {(source.commit or 'no commit')[:7]}")
    for r in doc["rows"]:
        if r.get("status") == "ok":
            qwen_rows.append({"run": run.format({"compile": "compiled"}.get(r["mode"], r["mode"])),
                              "variant": r["variant"], "step (ms)": r["step_ms"]["median"],
                              "step memory (GiB)": r.get("step_peak_gb")})
if qwen_rows:
    QWEN = table(qwen_rows)
    devices = ", ".join(dict.fromkeys(s.device or "an unrecorded device" for s in qwen_sources))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 5.5))
    bars(qwen_rows, "step (ms)", "median step time (ms)", "Step time (lower is better)", "{:.1f}", ax_t)
    bars([r for r in qwen_rows if r["step memory (GiB)"] is not None], "step memory (GiB)",
         "step peak above the models (GiB)", "Memory (lower is better)", "{:.2f}", ax_m)
    fig.suptitle(f"QK-norm models' LoRA step on the {devices}: the fused QK-norm + RoPE (normkit_rope)")
    fig.tight_layout()
    footnote(fig, "Committed results:\n" + "\n".join(s.label() for s in qwen_sources))
    show(fig)
    display(QWEN.round(3))
    for run, g in QWEN.groupby("run", sort=False):
        ms, mem = dict(zip(g["variant"], g["step (ms)"])), dict(zip(g["variant"], g["step memory (GiB)"]))
        if {"normkit", "normkit_rope"} <= ms.keys():
            print(f"{run.replace(chr(10), ', ')}: normkit_rope against normkit: time "
                  f"{ms['normkit_rope'] / ms['normkit']:.3f}x, memory {mem['normkit_rope'] / mem['normkit']:.3f}x"
                  + (f"; against hf: {ms['normkit_rope'] / ms['hf']:.3f}x, {mem['normkit_rope'] / mem['hf']:.3f}x"
                     if "hf" in ms else ""))
else:
    print("No Qwen3 or Gemma 3 LoRA-step results are committed (benchmarks/results/lora_step_*.json): run "
          "`benchmarks/lora_step.py --arch qwen3` (or gemma3) on the GPU machine and commit its JSON to draw this figure.")

# %% [markdown]
# ## Torch: a tiny Llama, LoRA, and `patch_model`
#
# The model is the benchmarks' (`benchmarks.models.llama_lora`): a random-init `LlamaForCausalLM` in a
# PEFT LoRA adapter, its norm weights drawn away from their init (HF starts them at 1) so that a dropped
# weight would show. One deep copy stays unpatched as the reference.

# %%
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's note that ipywidgets is absent
from benchmarks.models import llama_lora

# init_lora_weights=False draws B at random too (PEFT's default starts B at zero), so that every LoRA
# gradient, A's included, is non-zero from the first step.
reference, _ = llama_lora(layers=CFG["layers"], hidden=CFG["hidden"], heads=CFG["heads"], kv_heads=CFG["kv_heads"],
                          vocab=CFG["vocab"], intermediate=2 * CFG["hidden"], max_positions=2 * CFG["seq"],
                          device=DEVICE, seed=0, norms="hf", r=8, alpha=16, init_lora_weights=False,
                          targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
model = copy.deepcopy(reference)

report = tf.patch_model(model)
print(report)

# %% [markdown]
# ### What "matches" means: accuracy against float64
#
# Two float32 models that differ only in how their norms round cannot agree exactly: each has its own
# rounding error, and comparing them to each other with a fixed tolerance only guesses how large those
# errors may be (a guess that failed once at full size, by one element in 4096). So both are measured
# against the exact answer instead: the same step of the **unpatched model in float64**, whose rounding
# error (about 1e-16 relative) is negligible next to float32's. Its norms are HF's `LlamaRMSNorm` math
# evaluated in float64 (HF's forward casts its input to float32 first; here it keeps the input's dtype),
# and every model computes the loss in its own dtype (HF's `labels=` loss casts the logits to float32).
#
# For each compared quantity (the loss, each LoRA gradient tensor) with float64 value `g64`, errors are
# Euclidean norms over the tensor, both models in float32:
#
# - `err_nk = ||g_normkit - g64||` and `err_hf = ||g_hf - g64||` (the *reference err* columns below);
# - their ratio `ratio = err_nk / (err_hf + eps32 * ||g64||)`: normkit's error in units of HF's, with a
#   floor at float32's own resolution (a float32 result cannot be closer to `g64` than its rounding,
#   about `0.3 * eps32 * ||g64||`, so a tensor HF happens to get almost exactly right sets no bar lower).
#
# Pass when the **median ratio** over the training run's compared gradients is at most `TYPICAL = 2` and
# **every ratio** at most `CAP = 16`. The reading is "normkit's norms cost no more accuracy than HF's own". Why a median
# and not one factor per tensor: the two errors are of the same kind (float32 rounding in the norms,
# matmuls, softmax and loss, propagated through the network) but not the same realization (rounding the
# norms differently changes every rounding downstream), and a LoRA gradient's error is dominated by a few
# error components, so one tensor's ratio scatters widely. Measured on the H200 over 20 full-size steps x
# 40 LoRA gradients: median 0.9, 99th percentile 4.0, largest 5.6 (on the CPU, unfloored: median 1.0,
# largest 2.5); the errors of one step are correlated, so even the median of one step's 40 ratios reached
# 3, and only the whole run's median is judged. A real error in the norm is systematic and shifts every
# ratio at once: scaling normkit's dx by `1 + 1e-6` (8 float32 epsilons) moved the median ratio to 2.1 on
# the H200, `1 + 1e-5` to 20 (every ratio above 8, the largest 45), `1 + 1e-4` to 200. The cap catches an
# error confined to a few tensors.

# %%
EPS32 = float(torch.finfo(torch.float32).eps)  # 2^-23
TYPICAL, CAP = 2.0, 16.0


def _rms_norm_in_input_dtype(self, h):
    """HF LlamaRMSNorm's forward without its cast to float32."""
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


exact = copy.deepcopy(reference).double()  # the float64 reference: same parameters, same code
for m in exact.modules():
    if type(m).__name__ == "LlamaRMSNorm":
        m.forward = types.MethodType(_rms_norm_in_input_dtype, m)


def lm_loss(m, ids):
    """Next-token cross-entropy in the model's dtype (as HF's ``labels=`` loss, without its float32 cast)."""
    logits = m(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def lora(m):
    return {n: p for n, p in m.named_parameters() if p.requires_grad}


def accuracy(what, got, ref, f64):
    """normkit's and the float32 reference's (HF's) errors against float64, and their ratio (at most CAP)."""
    got, ref, f64 = (np.asarray(a, np.float64) for a in (got, ref, f64))
    err_nk, err_ref = float(np.linalg.norm(got - f64)), float(np.linalg.norm(ref - f64))
    ratio = err_nk / (err_ref + EPS32 * float(np.linalg.norm(f64)))
    assert ratio <= CAP, (f"{what}: normkit's float32 error {err_nk:.3g} is {ratio:.1f} x the reference's "
                          f"{err_ref:.3g} (floored); at most {CAP:g} (against float64)")
    return {"normkit err": err_nk, "reference err": err_ref, "ratio": ratio}


def typical(what, results):
    """The median ratio of ``accuracy`` results; at most TYPICAL."""
    median = float(np.median([r["ratio"] for r in results]))
    assert median <= TYPICAL, (f"{what}: normkit's float32 errors are typically {median:.2f} x the reference's; "
                               f"at most {TYPICAL:g} (against float64)")
    return median


SECONDS = {"hf": 0.0, "normkit": 0.0, "f64": 0.0}


def step_in_three(ids):
    """Loss and LoRA gradients of one step: patched and unpatched in float32, unpatched in float64, all
    from the unpatched model's current LoRA parameters. Leaves ``reference``'s gradients in place."""
    with torch.no_grad():
        for name, p in lora(reference).items():
            lora(model)[name].copy_(p)
            lora(exact)[name].copy_(p)
    results = {}
    for key, m in (("hf", reference), ("normkit", model), ("f64", exact)):
        t = time.perf_counter()
        loss = lm_loss(m, ids)
        loss.backward()
        results[key] = (loss.item(), {n: p.grad.double().cpu().numpy() for n, p in lora(m).items()})
        SECONDS[key] += time.perf_counter() - t  # .item() and .cpu() synchronize
    for m in (model, exact):
        m.zero_grad(set_to_none=True)
    return results


# %% [markdown]
# `patch_model` kept the very `Parameter` objects (PEFT had frozen them), so nothing about the
# optimizer setup changes:

# %%
norms = [(n, m) for n, m in model.named_modules() if isinstance(m, tf.RMSNorm)]
ref_modules = dict(reference.named_modules())
display(table([{"module": n.removeprefix("base_model.model."), "class": type(m).__name__,
                "eps": m.eps, "casting": m.casting_mode, "weight dtype": str(m.weight.dtype).removeprefix("torch."),
                "requires_grad": m.weight.requires_grad,
                "was": type(ref_modules[n]).__name__} for n, m in norms]))

# %% [markdown]
# ### One step, looked at closely
# The same batch through the three models: losses, every LoRA gradient (each float32 model's error
# against float64, and their ratio), the norm weights' `.grad`, and the launch record of the patched
# model's forward + backward.

# %%
gen = torch.Generator().manual_seed(1)


def batch():
    ids = torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["seq"]), generator=gen).to(DEVICE)
    return ids


ids = batch()
with normkit.record_launches() as log:  # only the patched model launches normkit kernels
    res = step_in_three(ids)

(loss_hf, g_hf), (loss_nk, g_nk), (loss_64, g_64) = res["hf"], res["normkit"], res["f64"]
print(f"loss: float64 {loss_64:.9f}   unpatched {loss_hf:.9f}   patched {loss_nk:.9f}")
accuracy("loss", loss_nk, loss_hf, loss_64)
rows = []
for name in g_64:
    rows.append({"LoRA parameter": name.removeprefix("base_model.model.model."),
                 "norm of grad": float(np.linalg.norm(g_64[name])),
                 **accuracy(f"grad {name}", g_nk[name], g_hf[name], g_64[name])})
assert all(m.weight.grad is None for _, m in norms), "a frozen norm weight got a gradient"
print(f"{len(rows)} LoRA gradients, error ratio: median {np.median([r['ratio'] for r in rows]):.2f}, max "
      f"{max(r['ratio'] for r in rows):.2f} (at most {CAP:g}); norm weights' .grad: "
      f"{sorted({str(m.weight.grad) for _, m in norms})}")
display(table(rows[:8] + ([{"LoRA parameter": f"... {len(rows) - 8} more"}] if len(rows) > 8 else []))
        .rename(columns={"normkit err": "normkit error (L2)", "reference err": "HF error (L2)",
                         "ratio": "error ratio normkit / HF (x)", "norm of grad": "|grad| (L2)"}))

# %% [markdown]
# The launch record of that step. The first input norm reads the frozen embeddings, so nothing
# upstream of it needs a gradient and it has no backward at all; every other norm runs the dx-only
# variant: `COMPUTE_DW=False`, no fp32 partial buffer, no `partial_sum_kernel`.

# %%
launch_rows = []
for launch in log:
    f = launch.flags
    launch_rows.append({"kernel": launch.kernel, "grid": launch.grid, "N": f["N"],
                        "COMPUTE_DX": f.get("COMPUTE_DX"), "COMPUTE_DW": f.get("COMPUTE_DW"),
                        "STORE_STATS": f.get("STORE_STATS"),
                        "partial buffers": ", ".join(n for n, _, _ in launch.partial_buffers) or "none"})
bwd = log.of("norm_bwd_kernel")
assert len(bwd) == 2 * CFG["layers"] and not any(b.flags["COMPUTE_DW"] for b in bwd)
assert not log.of("partial_sum_kernel")
print("kernels:", {k: log.kernels().count(k) for k in dict.fromkeys(log.kernels())})
display(table(launch_rows))

# %% [markdown]
# ### A few training steps
# AdamW on the unpatched model's LoRA parameters, the same synthetic batches. At every step the patched
# model and the float64 model are given the unpatched model's current LoRA parameters, and the three
# compute the loss and the LoRA gradients on the same batch: at every step the patched model must be as
# accurate as the unpatched one. (Two free-running trajectories would drift apart: a training loop
# amplifies float32 rounding differences from step to step, which is a property of training, not of
# the norm.) The figure and the table below it show each step's losses (the *reference* is the
# unpatched model, with HF's norms), each float32 model's loss error against float64 and, over the step's
# LoRA gradients, the median and largest error ratio; the median over all steps must be at most `TYPICAL`.

# %%
def step_row(step, loss64, loss_ref, loss_nk, acc):
    """One training step's losses (nats), the two float32 models' loss errors against float64, and the
    LoRA gradients' error ratios (``acc[0]`` is the loss's ``accuracy``, the rest the gradients')."""
    ratios = [a["ratio"] for a in acc[1:]]
    return {"step": step, "float64 loss (nats)": loss64, "reference loss (nats)": loss_ref,
            "normkit loss (nats)": loss_nk, "reference loss error (nats)": acc[0]["reference err"],
            "normkit loss error (nats)": acc[0]["normkit err"], "grad error ratio: median (x)": float(np.median(ratios)),
            "grad error ratio: max (x)": max(ratios)}


def training_figure(steps, reference_name, title):
    """Loss curves, loss errors against float64 and the gradients' error ratios, one step at a time."""
    fig, (ax_l, ax_e, ax_r) = plt.subplots(1, 3, figsize=(15, 3.8))
    x = steps["step"]
    ax_l.plot(x, steps["float64 loss (nats)"], color="0.6", lw=4, label="float64 (exact)")
    ax_l.plot(x, steps["reference loss (nats)"], color="tab:orange", marker="o", ms=4, label=reference_name)
    ax_l.plot(x, steps["normkit loss (nats)"], color="black", ls="--", marker="x", ms=5, label="normkit norms")
    ax_l.set_ylabel("cross-entropy loss (nats)")
    ax_l.set_title("Loss per step (the curves overlap)", fontsize=10)
    floor = EPS32 * steps["float64 loss (nats)"].abs().min()  # float32's resolution at this loss
    ax_e.plot(x, steps["reference loss error (nats)"].clip(lower=floor / 10), color="tab:orange", marker="o", ms=4,
              label=reference_name)
    ax_e.plot(x, steps["normkit loss error (nats)"].clip(lower=floor / 10), color="black", ls="--", marker="x", ms=5,
              label="normkit norms")
    ax_e.axhline(floor, color="0.5", lw=0.8, ls=":", label="eps32 x loss (float32's resolution)")
    ax_e.set_yscale("log")
    ax_e.set_ylabel("|loss − float64 loss| (nats)")
    ax_e.set_title("Loss error against float64 (lower is closer)", fontsize=10)
    ax_r.plot(x, steps["grad error ratio: median (x)"], color="black", marker="o", ms=4, label="median over the LoRA grads")
    ax_r.plot(x, steps["grad error ratio: max (x)"], color="tab:red", marker="^", ms=4, label="largest")
    ax_r.axhline(TYPICAL, color="black", lw=0.8, ls="--", label=f"TYPICAL = {TYPICAL:g} (the run's median)")
    ax_r.axhline(CAP, color="tab:red", lw=0.8, ls="--", label=f"CAP = {CAP:g} (every gradient)")
    ax_r.set_yscale("log")
    ax_r.set_ylabel("normkit's gradient error / reference's (x)")
    ax_r.set_title("LoRA gradients: error ratio (1 = as accurate)", fontsize=10)
    for ax in (ax_l, ax_e, ax_r):
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    footnote(fig, this_run(SIZE, "trained in this run") + ".\nLosses and errors are arithmetic, not speed: "
             "they mean the same at any size and on any device.")
    return fig


gen.manual_seed(2)
batches = [batch() for _ in range(CFG["steps"])]


def mean_loss(m):
    with torch.no_grad():
        return float(np.mean([lm_loss(m, ids).item() for ids in batches]))


reference.zero_grad(set_to_none=True)
loss_before = mean_loss(reference)
opt = torch.optim.AdamW(list(lora(reference).values()), lr=3e-3)
rows, compared = [], []
SECONDS.update(hf=0.0, normkit=0.0, f64=0.0)
for step, ids in enumerate(batches):
    res = step_in_three(ids)
    (loss_hf, g_hf), (loss_nk, g_nk), (loss_64, g_64) = res["hf"], res["normkit"], res["f64"]
    acc = [accuracy(f"step {step}: loss", loss_nk, loss_hf, loss_64)]
    acc += [accuracy(f"step {step}: grad {name}", g_nk[name], g_hf[name], g_64[name]) for name in g_64]
    compared += acc[1:]
    rows.append(step_row(step, loss_64, loss_hf, loss_nk, acc))
    opt.step()
    reference.zero_grad(set_to_none=True)
TORCH_STEPS = table(rows)
show(training_figure(TORCH_STEPS, "HF norms (unpatched)", "Torch: a tiny Llama with LoRA, HF norms against normkit's"))
display(TORCH_STEPS)

# %%
# Random tokens: each batch's loss is noise around ln(vocab); the mean over the training batches shows
# the learning.
loss_after = mean_loss(reference)
print(f"mean loss over the {CFG['steps']} training batches: {loss_before:.5f} before training, "
      f"{loss_after:.5f} after")
assert loss_after < loss_before, "the LoRA adapter did not learn"
assert all(m.weight.grad is None for _, m in norms)
median = typical(f"{CFG['steps']} steps", compared)
print(f"{CFG['steps']} steps x {len(g_64)} LoRA gradients: normkit's float32 error / HF's: median {median:.2f} "
      f"(at most {TYPICAL:g}), max {max(a['ratio'] for a in compared):.2f} (at most {CAP:g}); "
      "norm weights still without gradient")
if DEVICE.type == "cuda":
    print(f"forward+backward wall time over {CFG['steps']} steps: unpatched {SECONDS['hf']:.2f} s, "
          f"patched {SECONDS['normkit']:.2f} s, float64 {SECONDS['f64']:.2f} s")

# %% [markdown]
# `unpatch_model` puts the original modules back (the same objects), e.g. before saving with code that
# expects the original classes. The state dict never changed: same keys, same tensors.

# %%
keys = list(model.state_dict())
print(tf.unpatch_model(model))
assert list(model.state_dict()) == keys
assert all(type(m).__name__ == "LlamaRMSNorm" for n, m in model.named_modules() if n.endswith("norm"))

# %% [markdown]
# ## JAX: a transformer block with `freeze` masks and optax
#
# The same workflow in plain JAX: one pre-norm transformer block (causal attention + MLP) over a token
# embedding, a final norm and an LM head. The base weights are frozen; LoRA adapters on the query and
# value projections train. The norms are normkit's: `rms_norm` before attention, `fused_add_rms_norm`
# (residual add + norm in one pass) before the MLP and at the end.
#
# - `jax_frontend.freeze(params, trainable)` *inside* the loss makes the frozen leaves unperturbed in
#   normkit's `custom_vjp`, so the norm kernels skip dW (and their input's dx where nothing upstream trains).
# - `optax.multi_transform` gives the frozen leaves `set_to_zero`, so AdamW (and its weight decay)
#   only touches the adapters.
# - Correctness as in the Torch part: at every step, from the normkit model's current parameters, a
#   reference model identical except that its norms are written in plain `jnp` computes the loss and
#   the LoRA gradients in float32 and in float64 (`jax.enable_x64`); normkit's float32 errors against
#   float64 must be as small as the reference's, by the criterion of the Torch part (`TYPICAL`, `CAP`).

# %%
import jax
import jax.numpy as jnp
import optax

import jax_frontend as nk

# Full-precision float32 matmuls on every backend (GPUs would otherwise use TF32), so that the two
# models differ only in their norms.
jax.config.update("jax_default_matmul_precision", "highest")

JCFG = {"smoke": dict(d=64, heads=4, vocab=96, seq=16, batch=2, rank=4, steps=4),
        "full": dict(d=512, heads=8, vocab=1024, seq=128, batch=8, rank=8, steps=12)}[SIZE]
EPS = 1e-6


def init_params(key):
    d, v, r = JCFG["d"], JCFG["vocab"], JCFG["rank"]
    ks = iter(jax.random.split(key, 16))
    dense = lambda shape: jax.random.normal(next(ks), shape) / np.sqrt(shape[0])  # noqa: E731
    norm = lambda: {"weight": jax.random.uniform(next(ks), (d,), minval=0.5, maxval=1.5)}  # noqa: E731
    return {
        "embed": jax.random.normal(next(ks), (v, d)),
        "block": {"attn_norm": norm(), "wq": dense((d, d)), "wk": dense((d, d)), "wv": dense((d, d)),
                  "wo": dense((d, d)), "mlp_norm": norm(), "w1": dense((d, 4 * d)), "w2": dense((4 * d, d))},
        "final_norm": norm(),
        "head": dense((d, v)),
        # Both LoRA factors random (not B = 0), so every adapter gradient is non-zero from the start.
        "lora": {name: {"a": dense((d, r)), "b": dense((r, d)) * 0.1} for name in ("q", "v")},
    }


# A prefix of the parameter tree: one bool per subtree.
TRAINABLE = {"embed": False, "block": False, "final_norm": False, "head": False, "lora": True}

NORMKIT_NORMS = {"rms_norm": lambda x, w: nk.rms_norm(x, w, EPS),
                 "fused_add_rms_norm": lambda x, r, w: nk.fused_add_rms_norm(x, r, w, EPS)}


def _ref_rms(x, w):  # in x's dtype: float32 here, float64 for the float64 reference
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


REF_NORMS = {"rms_norm": _ref_rms, "fused_add_rms_norm": lambda x, r, w: (_ref_rms(x + r, w), x + r)}


def forward(params, ids, norms):
    p, blk = params, params["block"]
    B, T = ids.shape
    H, d = JCFG["heads"], JCFG["d"]
    x = p["embed"][ids]
    h = norms["rms_norm"](x, blk["attn_norm"]["weight"])
    lora = lambda name: p["lora"][name]["a"] @ p["lora"][name]["b"]  # noqa: E731
    q = (h @ (blk["wq"] + lora("q"))).reshape(B, T, H, d // H)
    k = (h @ blk["wk"]).reshape(B, T, H, d // H)
    v = (h @ (blk["wv"] + lora("v"))).reshape(B, T, H, d // H)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // H)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e30)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, d) @ blk["wo"]
    h2, resid = norms["fused_add_rms_norm"](attn, x, blk["mlp_norm"]["weight"])
    mlp = jax.nn.gelu(h2 @ blk["w1"]) @ blk["w2"]
    h3, _ = norms["fused_add_rms_norm"](mlp, resid, p["final_norm"]["weight"])
    return h3 @ p["head"]


def loss_fn(params, ids, norms):
    params = nk.freeze(params, TRAINABLE)  # frozen leaves: stop_gradient, so normkit skips their work
    logits = forward(params, ids, norms)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


labels = jax.tree_util.tree_map_with_path(lambda path, _: "train" if path[0].key == "lora" else "frozen",
                                          init_params(jax.random.key(0)))
optimizer = optax.multi_transform({"train": optax.adamw(3e-3, weight_decay=0.01), "frozen": optax.set_to_zero()},
                                  labels)


def make_step(norms):
    @jax.jit
    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, norms)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads
    return step


params0 = init_params(jax.random.key(0))
jbatches = [jax.random.randint(k, (JCFG["batch"], JCFG["seq"]), 0, JCFG["vocab"])
            for k in jax.random.split(jax.random.key(1), JCFG["steps"])]
print("parameter tree:", jax.tree.map(lambda a: a.shape, params0))

# %% [markdown]
# Train the normkit model. At every step, before the update, the reference computes the same loss and
# gradients from the same parameters, in float32 and in float64. The first call of the normkit step is
# traced and compiled, and that is when its launches are recorded. In the figure and table, the
# *reference* is the same model with plain `jnp` norms.

# %%
_ref_grad = jax.jit(jax.value_and_grad(lambda params, ids: loss_fn(params, ids, REF_NORMS)))


def reference_step(params, ids, dtype):
    """(loss, gradients) of the pure-jnp reference model in ``dtype``, as float64 NumPy."""
    with jax.enable_x64(dtype == jnp.float64):
        loss, grads = _ref_grad(jax.tree.map(lambda a: jnp.asarray(a, dtype), params), ids)
        return float(loss), jax.tree.map(lambda a: np.asarray(a, np.float64), grads)


def lora_leaves(grads):
    return {"lora" + jax.tree_util.keystr(path): np.asarray(g, np.float64)
            for path, g in jax.tree_util.tree_flatten_with_path(grads["lora"])[0]}


step_nk, params_nk, opt_state = make_step(NORMKIT_NORMS), params0, optimizer.init(params0)
rows, jcompared, grads_nk = [], [], None
with normkit.record_launches() as jlog:
    for i, ids in enumerate(jbatches):
        loss32, g32 = reference_step(params_nk, ids, jnp.float32)
        loss64, g64 = reference_step(params_nk, ids, jnp.float64)
        params_nk, opt_state, loss, grads = step_nk(params_nk, opt_state, ids)
        grads_nk = grads if grads_nk is None else grads_nk  # the first step's, for the frozen-leaf check
        acc = [accuracy(f"step {i}: loss", float(loss), loss32, loss64)]
        g_nk, g32, g64 = lora_leaves(grads), lora_leaves(g32), lora_leaves(g64)
        acc += [accuracy(f"step {i}: grad {name}", g_nk[name], g32[name], g64[name]) for name in g64]
        jcompared += acc[1:]
        rows.append(step_row(i, loss64, loss32, float(loss), acc))
JAX_STEPS = table(rows)
show(training_figure(JAX_STEPS, "plain jnp norms", "JAX: a transformer block with LoRA, jnp norms against normkit's"))
display(JAX_STEPS)

# %%
# Frozen leaves: zero gradients (symbolic zeros, instantiated) and, after training, unchanged values.
for top in ("embed", "block", "final_norm", "head"):
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads_nk[top])), top
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params_nk[top]), jax.tree.leaves(params0[top]))), top
median = typical(f"{JCFG['steps']} steps", jcompared)
print(f"{JCFG['steps']} steps x {len(g64)} LoRA gradients: normkit's float32 error / the jnp reference's: median "
      f"{median:.2f} (at most {TYPICAL:g}), max {max(a['ratio'] for a in jcompared):.2f} (at most {CAP:g}); "
      "frozen leaves have zero gradients and did not move")
display(table([{"LoRA leaf": name, "|grad| (L2)": float(np.linalg.norm(g64[name])),
                **accuracy(name, g_nk[name], g32[name], g64[name])} for name in g64])
        .rename(columns={"normkit err": "normkit error (L2)", "reference err": "jnp error (L2)",
                         "ratio": "error ratio normkit / jnp (x)"}))

# %% [markdown]
# The norm launches of the normkit model's training step. The attention norm reads the frozen
# embedding, so nothing it feeds back to trains: no backward at all. The two fused add + RMSNorm
# calls need dx (the LoRA adapters sit upstream) but no dW: no partial buffer, no reduction.
#
# Under `jit` a launch is recorded when the computation is lowered, and JAX lowers identical
# primitive calls once: the two fused forwards (same shape, same flags) show as one row. Their
# backwards differ (only the first one's `residual_out` has a gradient: `HAS_DRES`), so both show.

# %%
jrows = [{"kernel": l.kernel, "frontend": l.frontend, "N": l.flags["N"], "STORE_STATS": l.flags.get("STORE_STATS"),
          "HAS_RESIDUAL": l.flags.get("HAS_RESIDUAL"), "HAS_DRES": l.flags.get("HAS_DRES"), "COMPUTE_DX": l.flags.get("COMPUTE_DX"),
          "COMPUTE_DW": l.flags.get("COMPUTE_DW"), "partial buffers": len(l.partial_buffers)} for l in jlog]
jbwd = jlog.of("norm_bwd_kernel")
assert len(jbwd) == 2 and all(b.flags["COMPUTE_DX"] and not b.flags["COMPUTE_DW"] for b in jbwd)
assert not jlog.of("partial_sum_kernel")
display(table(jrows))
