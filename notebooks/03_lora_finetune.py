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
# A fine-tuner's view of the frozen-parameter backward: drop normkit into a model that is already
# being trained, without touching its code.
#
# - **Torch**: a small `LlamaForCausalLM` built from a config (random init, nothing downloaded), wrapped
#   in a PEFT LoRA adapter, then `torch_frontend.patch_model(model)`. A few AdamW steps on synthetic
#   tokens; the losses and LoRA gradients must match the unpatched model, the (frozen) norm weights must
#   get no gradient, and the launch record must show the dW-free backward.
# - **JAX**: the same idea on a small transformer block in plain JAX, with `jax_frontend.freeze` masks
#   and optax; its losses must match a pure-`jnp` reference model.
#
# Sizes follow `NORMKIT_NOTEBOOK_SIZE` (`smoke` on CPU, where Triton runs in its interpreter; `full` on a GPU).

# %%
import copy
import time
import warnings

import numpy as np
import torch

from _nbutil import environment, notebook_size, table

import normkit
import torch_frontend as tf
from tests.tolerances import assert_close

SIZE = notebook_size()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CFG = {
    "smoke": dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab=96, seq=16, batch=2, steps=4),
    "full": dict(hidden=512, layers=4, heads=8, kv_heads=4, vocab=1024, seq=128, batch=8, steps=20),
}[SIZE]
print(f"size: {SIZE}", CFG)
table([environment()])

# %% [markdown]
# ## Torch: a tiny Llama, LoRA, and `patch_model`
#
# The norm weights are set away from their init (HF starts them at 1), so a dropped weight would show.
# One deep copy stays unpatched as the reference.

# %%
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's note that ipywidgets is absent
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=CFG["vocab"], hidden_size=CFG["hidden"], intermediate_size=2 * CFG["hidden"],
                     num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"],
                     num_key_value_heads=CFG["kv_heads"], max_position_embeddings=2 * CFG["seq"])
base = LlamaForCausalLM(config)
with torch.no_grad():
    for name, p in base.named_parameters():
        if "norm" in name:
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))

with warnings.catch_warnings():
    # peft 0.21 calls transformers' deprecated is_gradient_checkpointing; harmless here.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # init_lora_weights=False draws B at random too (PEFT's default starts B at zero), so that every
    # LoRA gradient, A's included, is non-zero from the first step.
    lora_cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    reference = get_peft_model(base, lora_cfg).to(DEVICE)
model = copy.deepcopy(reference)

report = tf.patch_model(model)
print(report)

# %% [markdown]
# `patch_model` kept the very `Parameter` objects (PEFT had frozen them), so nothing about the
# optimizer setup changes:

# %%
norms = [(n, m) for n, m in model.named_modules() if isinstance(m, tf.RMSNorm)]
ref_modules = dict(reference.named_modules())
table([{"module": n.removeprefix("base_model.model."), "class": type(m).__name__,
        "eps": m.eps, "casting": m.casting_mode, "weight dtype": str(m.weight.dtype).removeprefix("torch."),
        "requires_grad": m.weight.requires_grad,
        "was": type(ref_modules[n]).__name__} for n, m in norms])

# %% [markdown]
# ### One step, looked at closely
# The same batch through both models: losses, every LoRA gradient, the norm weights' `.grad`, and the
# launch record of the patched model's forward + backward.

# %%
gen = torch.Generator().manual_seed(1)


def batch():
    ids = torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["seq"]), generator=gen).to(DEVICE)
    return ids


ids = batch()
out_ref = reference(input_ids=ids, labels=ids)
out_ref.loss.backward()
with normkit.record_launches() as log:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()

ref_params = dict(reference.named_parameters())
rows = []
for name, p in model.named_parameters():
    if p.requires_grad:
        g, g_ref = p.grad.double().cpu().numpy(), ref_params[name].grad.double().cpu().numpy()
        rows.append({"LoRA parameter": name.removeprefix("base_model.model.model."),
                     "max abs grad": float(np.abs(g_ref).max()),
                     "max abs difference": float(np.abs(g - g_ref).max())})
        assert_close(g, g_ref, "float32", f"grad {name}")
print(f"loss: unpatched {out_ref.loss.item():.6f}   patched {out.loss.item():.6f}")
assert_close(out.loss.item(), out_ref.loss.item(), "float32", "loss")
assert all(m.weight.grad is None for _, m in norms), "a frozen norm weight got a gradient"
print(f"{len(rows)} LoRA gradients match (float32 tolerance); norm weights' .grad: "
      f"{sorted({str(m.weight.grad) for _, m in norms})}")
table(rows[:8] + ([{"LoRA parameter": f"... {len(rows) - 8} more"}] if len(rows) > 8 else []))

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
table(launch_rows)

# %% [markdown]
# ### A few training steps
# AdamW on the LoRA parameters, the same synthetic batches. At every step the patched model is given
# the unpatched model's current LoRA parameters, and both compute the loss and the LoRA gradients on
# the same batch: they must agree step by step. (Two free-running trajectories would not stay this
# close: a training loop amplifies float32 differences in reduction order from step to step, which
# is a property of training, not of the norm.)

# %%
def lora(m):
    return {n: p for n, p in m.named_parameters() if p.requires_grad}


gen.manual_seed(2)
batches = [batch() for _ in range(CFG["steps"])]
for m in (model, reference):
    m.zero_grad(set_to_none=True)
opt = torch.optim.AdamW(list(lora(reference).values()), lr=3e-3)
rows, worst_grad = [], 0.0
t_ref = t_patched = 0.0
for step, ids in enumerate(batches):
    with torch.no_grad():
        for name, p in lora(model).items():
            p.copy_(lora(reference)[name])
    t = time.perf_counter()
    loss_ref = reference(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    t_ref += time.perf_counter() - t
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    t_patched += time.perf_counter() - t
    assert_close(loss.item(), loss_ref.item(), "float32", f"loss at step {step}")
    for name, p in lora(model).items():
        g, g_ref = p.grad.double().cpu().numpy(), lora(reference)[name].grad.double().cpu().numpy()
        assert_close(g, g_ref, "float32", f"step {step}: grad {name}")
        worst_grad = max(worst_grad, float(np.abs(g - g_ref).max()))
    rows.append({"step": step, "unpatched loss": loss_ref.item(), "patched loss": loss.item(),
                 "abs difference": abs(loss.item() - loss_ref.item())})
    opt.step()
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
table(rows, floatfmt=".6g")

# %%
assert rows[-1]["unpatched loss"] < rows[0]["unpatched loss"], "the LoRA adapter did not learn"
assert all(m.weight.grad is None for _, m in norms)
print(f"{CFG['steps']} steps: max |Δloss| = {max(r['abs difference'] for r in rows):.2e}, "
      f"max |Δgrad| = {worst_grad:.2e}; norm weights still without gradient")
if DEVICE.type == "cuda":
    print(f"forward+backward wall time over {CFG['steps']} steps (first calls compile): "
          f"unpatched {t_ref:.2f} s, patched {t_patched:.2f} s")

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
# - A reference model, identical except that its norms are written in plain `jnp`, trains side by side
#   from the same initial parameters on the same batches; the losses must agree.

# %%
import jax
import jax.numpy as jnp
import optax

import jax_frontend as nk

# Full-precision float32 matmuls on every backend (GPUs would otherwise use TF32), so that the two
# models differ only in their norms.
jax.config.update("jax_default_matmul_precision", "highest")

JCFG = {"smoke": dict(d=64, heads=4, vocab=96, seq=16, batch=2, rank=4, steps=4),
        "full": dict(d=512, heads=8, vocab=1024, seq=128, batch=8, rank=8, steps=20)}[SIZE]
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


def _ref_rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS) * w).astype(x.dtype)


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
# Train both models. The first call of the normkit step is traced and compiled, and that is when its
# launches are recorded.

# %%
def train_jax(norms, record=False):
    step, params, opt_state = make_step(norms), params0, optimizer.init(params0)
    losses, first_grads = [], None
    with normkit.record_launches() as jlog:
        for ids in jbatches:
            params, opt_state, loss, grads = step(params, opt_state, ids)
            losses.append(float(loss))
            first_grads = grads if first_grads is None else first_grads
    return params, losses, first_grads, jlog


params_nk, losses_nk, grads_nk, jlog = train_jax(NORMKIT_NORMS)
params_ref, losses_ref_j, grads_ref, _ = train_jax(REF_NORMS)
table([{"step": i, "pure-jnp reference loss": a, "normkit loss": b, "abs difference": abs(a - b)}
       for i, (a, b) in enumerate(zip(losses_ref_j, losses_nk))], floatfmt=".6g")

# %%
np.testing.assert_allclose(losses_nk, losses_ref_j, rtol=1e-4, atol=1e-5)
rows = []
for (path, g), (_, g_ref) in zip(jax.tree_util.tree_flatten_with_path(grads_nk["lora"])[0],
                                  jax.tree_util.tree_flatten_with_path(grads_ref["lora"])[0]):
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    assert np.abs(g_ref).max() > 0
    assert_close(g, g_ref, "float32", f"lora{jax.tree_util.keystr(path)}")
    rows.append({"LoRA leaf": "lora" + jax.tree_util.keystr(path), "max abs grad": float(np.abs(g_ref).max()),
                 "max abs difference": float(np.abs(g - g_ref).max())})
# Frozen leaves: zero gradients (symbolic zeros, instantiated) and, after training, unchanged values.
for top in ("embed", "block", "final_norm", "head"):
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads_nk[top])), top
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params_nk[top]), jax.tree.leaves(params0[top]))), top
print(f"{JCFG['steps']} steps: losses agree (max |Δ| {max(abs(a - b) for a, b in zip(losses_nk, losses_ref_j)):.2e}); "
      "frozen leaves have zero gradients and did not move")
table(rows)

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
table(jrows)
