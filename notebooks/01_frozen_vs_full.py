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
# # 01 · Frozen vs full backward: what changes
#
# In LoRA/PEFT fine-tuning the norm weights are frozen. normkit's backward then skips their gradient
# entirely: the kernel variant with `COMPUTE_DW=False` runs, no fp32 partial buffer is allocated, and
# the `partial_sum_kernel` that reduces the partials into dW is never launched.
#
# This notebook runs **every op** (RMSNorm, LayerNorm, fused residual-add + RMSNorm) through **both
# frontends** (Torch and JAX), once with every parameter trained (*full*) and once with the parameters
# frozen (*frozen*), and shows
#
# 1. the launch record: which kernel variant ran, which partial buffers were allocated, and the bytes
#    the backward moves;
# 2. gradient agreement with the float64 reference (`normkit.reference`) and between the frontends;
# 3. the `jax_frontend.freeze` mask pattern on a small parameter tree.
#
# In Torch a parameter is frozen with `requires_grad=False` (the autograd Function reads
# `ctx.needs_input_grad`); in JAX with `jax_frontend.freeze(params, trainable)` inside the loss, which
# applies `stop_gradient`, seen by the `custom_vjp` as an unperturbed input.

# %%
from _nbutil import environment, notebook_size, table  # first: puts the repository on sys.path

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_frontend as nk
import normkit
import torch_frontend as tf
from normkit.ops import OPS
from normkit.testing import TOLERANCES, assert_close, random_inputs

SIZE = notebook_size()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
M, N = {"smoke": (48, 256), "full": (4096, 4096)}[SIZE]  # full: Llama-3-8B hidden size, 4k tokens
DTYPES = ["float32", "bfloat16"]
VARIANTS = ["full", "frozen"]  # full: parameters trained; frozen: parameters frozen. x is trained in both.
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
JAX_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
print(f"size: {SIZE}; x is {M} x {N}")
table([environment()])

# %% [markdown]
# Every op is a row of normkit's op table (`normkit.ops.OPS`): its inputs in signature order (the row
# inputs, then the parameters), its outputs and its default `eps`. The code below reads them from there
# and never tests an op's name; each public function takes the op's inputs positionally in that order.

# %%
table([{"op": op.name, "inputs": ", ".join(op.inputs), "row inputs": ", ".join(op.row_inputs),
        "parameters": ", ".join(op.params), "outputs": ", ".join(op.outputs), "default eps": op.default_eps}
       for op in OPS.values()])

# %% [markdown]
# ## Inputs and the float64 reference
# Fresh random inputs (`normkit.testing.random_inputs`), rounded to the dtype once, so every
# implementation and the reference see the same values. The weight has random signs and magnitudes in
# [0.5, 1.5]; `dy` (and `ds`, the gradient of the fused op's `residual_out`) are random too. The
# reference is the op's float64 forward and closed-form backward (`op.run_reference`).

# %%
rng = np.random.default_rng(2024)


def make_inputs(op, dtype):
    return random_inputs(op, (M, N), dtype, rng)


def reference(op, inp):
    """(outputs, gradients of every input) in float64."""
    opts = op.options(eps=op.default_eps)
    return op.run_reference(inp, opts, {"y": inp["dy"], "residual_out": inp.get("ds")})


# %% [markdown]
# ## The two frontends
# Each runner takes the same inputs and returns outputs, gradients (None where Torch computed none) and
# the launch record. The JAX loss is `sum(y * dy) (+ sum(residual_out * ds))`, whose gradient with
# respect to the outputs is exactly `dy` (and `ds`): the same cotangents Torch's `backward` receives.

# %%
def apply(module, op, inputs):
    """``op`` from a frontend's module on named inputs: outputs by name. Every public function takes the
    op's inputs positionally in ``op.inputs`` order."""
    out = getattr(module, op.name)(*(inputs[k] for k in op.inputs), eps=op.default_eps)
    return dict(zip(op.outputs, out if op.has_residual else (out,)))


def run_torch(op, dtype, variant, inp):
    t = {k: torch.from_numpy(v).to(DEVICE, TORCH_DT[dtype]) for k, v in inp.items()}
    for k in op.row_inputs:
        t[k].requires_grad_(True)
    for k in op.params:
        t[k].requires_grad_(variant == "full")
    with normkit.record_launches() as log:
        outs = apply(tf, op, t)
        cts = {"y": t["dy"], "residual_out": t.get("ds")}
        torch.autograd.backward(list(outs.values()), [cts[k] for k in outs])
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    as_np = lambda a: None if a is None else a.detach().double().cpu().numpy()  # noqa: E731
    grads = {k: as_np(t[k].grad) for k in op.inputs}
    return {k: as_np(v) for k, v in outs.items()}, grads, log


def run_jax(op, dtype, variant, inp):
    arr = {k: jnp.asarray(v, dtype=jnp.float32).astype(JAX_DT[dtype]) for k, v in inp.items()}
    acts = {k: arr[k] for k in op.row_inputs}
    params = {k: arr[k] for k in op.params}
    cts = {"y": arr["dy"].astype(jnp.float32), "residual_out": arr.get("ds", arr["dy"]).astype(jnp.float32)}
    trainable = {k: variant == "full" for k in params}

    def loss(acts, params):
        params = nk.freeze(params, trainable)  # stop_gradient on the frozen leaves
        outs = apply(nk, op, {**acts, **params})
        return sum(jnp.sum(o.astype(jnp.float32) * cts[k]) for k, o in outs.items()), outs

    with normkit.record_launches() as log:  # under jit, launches are recorded when traced
        (_, outs), (g_acts, g_params) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(acts, params)
        jax.block_until_ready(g_acts)
    as_np = lambda a: np.asarray(a.astype(jnp.float32), dtype=np.float64)  # noqa: E731
    grads = {**{k: as_np(v) for k, v in g_acts.items()}, **{k: as_np(v) for k, v in g_params.items()}}
    return {k: as_np(v) for k, v in outs.items()}, grads, log


FRONTENDS = {"torch": run_torch, "jax": run_jax}

# %% [markdown]
# ## Running every case
# For each op, dtype and variant, both frontends run on the same inputs. Only summaries are kept:
# the launch records, and per array the share of the tolerance used (against the reference) and the
# largest difference between the frontends. Every comparison is also asserted with the project's one
# tolerance table (`normkit.testing.TOLERANCES`), so a disagreement stops the notebook.

# %%
def tol_share(actual, expected, dtype, reduced_over=1):
    """max |actual - expected| / (atol * sqrt(reduced_over) + rtol * |expected|): below 1 passes."""
    tol = TOLERANCES[dtype]
    budget = tol["atol"] * np.sqrt(reduced_over) + tol["rtol"] * np.abs(expected)
    return float(np.max(np.abs(actual - expected) / budget))


LOGS, AGREE, CROSS = {}, [], []
for op in OPS.values():
    for dtype in DTYPES:
        inp = make_inputs(op, dtype)
        ref_outs, ref_grads = reference(op, inp)
        for variant in VARIANTS:
            res = {fe: run(op, dtype, variant, inp) for fe, run in FRONTENDS.items()}
            for fe, (outs, grads, log) in res.items():
                LOGS[fe, op.name, dtype, variant] = log
                row = {"frontend": fe, "op": op.name, "dtype": dtype, "variant": variant}
                for k, r in ref_outs.items():
                    assert_close(outs[k], r, dtype, f"{fe} {op.name} {dtype} {variant}: {k}")
                    row[k] = tol_share(outs[k], r, dtype)
                for k, r in ref_grads.items():
                    what = f"{fe} {op.name} {dtype} {variant}: d{k}"
                    if k in op.params and variant == "frozen":
                        # Torch: no gradient at all; JAX: a symbolic zero, instantiated as zeros by grad.
                        assert grads[k] is None if fe == "torch" else not np.any(grads[k]), what
                        row[k] = "frozen"
                        continue
                    reduced = M if k in op.params else 1
                    assert_close(grads[k], r, dtype, what, reduced_over=reduced)
                    row[k] = tol_share(grads[k], r, dtype, reduced)
                AGREE.append(row)
            (t_outs, t_grads, _), (j_outs, j_grads, _) = res["torch"], res["jax"]
            row, same, n = {"op": op.name, "dtype": dtype, "variant": variant}, 0, 0
            for k in op.outputs + op.inputs:
                t, j = (t_outs[k], j_outs[k]) if k in op.outputs else (t_grads[k], j_grads[k])
                if t is None:
                    row[k] = "frozen"
                    continue
                assert_close(j, t, dtype, f"jax vs torch {op.name} {dtype} {variant}: {k}",
                             reduced_over=M if k in op.params else 1)
                row[k] = float(np.max(np.abs(t - j)))
                same, n = same + bool(np.array_equal(t, j)), n + 1
            row["bitwise equal"] = f"{same}/{n}"
            CROSS.append(row)
            del res
print(f"{len(AGREE)} runs: {len(FRONTENDS)} frontends x {len(OPS)} ops x {len(DTYPES)} dtypes x {len(VARIANTS)} variants")

# %% [markdown]
# ## 1. The launch record: which variant ran, what was allocated
#
# For each run, the backward launch's `COMPUTE_*` flags, its grid, the fp32 partial buffers it wrote
# (one row of N per program) and whether the `partial_sum_kernel` reduction ran. *Backward bytes* is a
# traffic model of the backward: read x and dy (and `ds`), write dx; with dW/dB also write the fp32
# partials, read them back in the reduction, and write dW/dB.

# %%
def fmt_partials(launch):
    return ", ".join(f"{name} {'x'.join(map(str, shape))} {dt}" for name, shape, dt in launch.partial_buffers) or "none"


def backward_bytes(op, dtype, log):
    item = torch.finfo(TORCH_DT[dtype]).bits // 8
    tensors = 3 + op.has_residual  # x, dy, dx (+ ds)
    total = tensors * M * N * item + N * item  # + weight read
    for launch in log.of("norm_bwd_kernel"):
        total += 2 * launch.partial_bytes  # written by the backward, read by the reduction
    for launch in log.of("partial_sum_kernel"):
        total += N * item * (launch.flags["HAS_DW"] + launch.flags["HAS_DB"])
    return total


launch_rows = []
for (fe, name, dtype, variant), log in LOGS.items():
    if dtype != "bfloat16":
        continue  # the variants do not depend on the dtype
    op = OPS[name]
    (bwd,) = log.of("norm_bwd_kernel")
    f = bwd.flags
    launch_rows.append({
        "frontend": fe, "op": name, "variant": variant,
        "launches": " → ".join(k.removesuffix("_kernel") for k in log.kernels()),
        "DX": f["COMPUTE_DX"], "DW": f["COMPUTE_DW"], "DB": f["COMPUTE_DB"], "bwd grid": bwd.grid[0],
        "partial buffers": fmt_partials(bwd), "partial bytes": bwd.partial_bytes,
        "backward bytes (model)": backward_bytes(op, dtype, log),
    })
    # The frozen variant must run without dW/dB work, partials or reduction; the full one with them.
    full = variant == "full"
    assert f["COMPUTE_DW"] == full and f["COMPUTE_DB"] == (full and "bias" in op.params)
    assert bool(bwd.partial_buffers) == full and bool(log.of("partial_sum_kernel")) == full
    assert [l.flags for l in log.of("norm_bwd_kernel")] == [l.flags for l in LOGS["torch", name, dtype, variant].of("norm_bwd_kernel")]
table(launch_rows)

# %% [markdown]
# The same numbers as savings: what freezing removes from the backward at this shape (bf16). The
# partials scale with the number of programs, not with M, so at large M they are a small share of the
# bytes; there freezing mostly removes the dW accumulation work and the second launch (notebook 02).

# %%
saving_rows = []
for fe in FRONTENDS:
    for op in OPS:
        by = {r["variant"]: r for r in launch_rows if r["frontend"] == fe and r["op"] == op}
        saving_rows.append({"frontend": fe, "op": op,
                            "launches full → frozen": f"{len(by['full']['launches'].split(' → '))} → "
                                                      f"{len(by['frozen']['launches'].split(' → '))}",
                            "partial bytes saved": by["full"]["partial bytes"] - by["frozen"]["partial bytes"],
                            "backward bytes full": by["full"]["backward bytes (model)"],
                            "backward bytes frozen": by["frozen"]["backward bytes (model)"],
                            "bytes saved": 1 - by["frozen"]["backward bytes (model)"] / by["full"]["backward bytes (model)"]})
table(saving_rows, floatfmt=".1%")

# %% [markdown]
# ## 2. Gradient agreement with the float64 reference
#
# Each cell is the **share of the tolerance used**, `max |actual − ref| / (atol·scale + rtol·|ref|)`,
# with scale = √M for dW and dB (sums over M rows): below 1 passes. Columns name the output (`y`,
# `residual_out`) or the input whose gradient is compared. Frozen parameters show *frozen*: Torch
# produced no gradient (`.grad is None`) and JAX a symbolic zero (instantiated as zeros by `jax.grad`).

# %%
TOL_COLUMNS = ["y", "residual_out", "x", "residual", "weight", "bias"]
table(AGREE, ["frontend", "op", "dtype", "variant"] + TOL_COLUMNS, floatfmt=".2f")

# %% [markdown]
# ## 3. Agreement across the frontends
#
# Both frontends plan their launches with the same function (`normkit.launch`) and run the same
# kernels with the same flags, so they should agree far more closely than either agrees with the
# reference. Each cell is `max |torch − jax|`; the last column counts the arrays that are bitwise equal.

# %%
table(CROSS, ["op", "dtype", "variant"] + TOL_COLUMNS + ["bitwise equal"], floatfmt=".2g")

# %% [markdown]
# ## 4. The `jax_frontend.freeze` mask pattern
#
# `freeze(params, trainable)` takes a mask with the structure of `params` **or a prefix of it** (one
# bool for a whole subtree), or a callable `params -> mask` as `optax.masked` does. Apply it *inside*
# the loss, where the gradient is taken: the frozen leaves are then unperturbed inside normkit's
# `custom_vjp`, and their kernels skip the work. (An optimizer mask alone only masks the updates: the
# frozen gradients would still be computed.)
#
# A small block: an RMSNorm before a projection, and a LayerNorm after it whose weight is frozen but
# whose bias trains — one mask entry per leaf where it matters, one bool per subtree elsewhere.

# %%
D = 64
k = iter(jax.random.split(jax.random.key(7), 8))
block_params = {
    "norm1": {"weight": jax.random.uniform(next(k), (D,), minval=0.5, maxval=1.5)},
    "proj": {"w": jax.random.normal(next(k), (D, D)) / np.sqrt(D), "lora_a": jax.random.normal(next(k), (D, 4)) * 0.1,
             "lora_b": jax.random.normal(next(k), (4, D)) * 0.1},
    "norm2": {"weight": jax.random.uniform(next(k), (D,), minval=0.5, maxval=1.5),
              "bias": jax.random.normal(next(k), (D,)) * 0.1},
}
trainable = {
    "norm1": False,                                                # a whole subtree: one bool
    "proj": {"w": False, "lora_a": True, "lora_b": True},          # leaf by leaf
    "norm2": {"weight": False, "bias": True},
}
# The same mask written as a callable on key paths:
by_path = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
    lambda path, _: "lora" in jax.tree_util.keystr(path) or jax.tree_util.keystr(path) == "['norm2']['bias']", p)
xb = jax.random.normal(next(k), (16, D))


def block(params, x):
    h = nk.rms_norm(x, params["norm1"]["weight"])
    h = h @ (params["proj"]["w"] + params["proj"]["lora_a"] @ params["proj"]["lora_b"])
    return nk.layer_norm(x + h, params["norm2"]["weight"], params["norm2"]["bias"])


def block_loss(params, x, mask):
    return jnp.mean(block(nk.freeze(params, mask), x) ** 2)


with normkit.record_launches() as block_log:
    block_grads = jax.grad(block_loss)(block_params, xb, trainable)
grads_by_path = jax.grad(block_loss)(block_params, xb, by_path)

leaf_rows = []
for (path, g), (_, g2) in zip(jax.tree_util.tree_flatten_with_path(block_grads)[0],
                              jax.tree_util.tree_flatten_with_path(grads_by_path)[0]):
    name = jax.tree_util.keystr(path)
    is_trainable = any(s in name for s in ("lora", "['norm2']['bias']"))
    leaf_rows.append({"leaf": name, "shape": tuple(g.shape), "trainable": is_trainable,
                      "max abs grad": float(jnp.max(jnp.abs(g)))})
    assert bool(jnp.any(g != 0)) == is_trainable, name
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g2))  # the callable mask is the same mask
table(leaf_rows)

# %% [markdown]
# What the norms' kernels did under that mask: `norm1` (weight frozen, its input `x` is not
# differentiated either) has no backward at all; `norm2` computes dx and dB but no dW: one partial
# buffer (`DB_PART`), not two.

# %%
rows = []
for launch in block_log:
    f = launch.flags
    op = {True: "rms_norm", False: "layer_norm", None: ""}[f.get("IS_RMS")]
    rows.append({"kernel": launch.kernel, "op": op, "STORE_STATS": f.get("STORE_STATS"),
                 "DX": f.get("COMPUTE_DX"), "DW": f.get("COMPUTE_DW"), "DB": f.get("COMPUTE_DB"),
                 "partial buffers": fmt_partials(launch), "frontend": launch.frontend})
bwd = block_log.of("norm_bwd_kernel")
assert len(bwd) == 1 and not bwd[0].flags["IS_RMS"]
assert (bwd[0].flags["COMPUTE_DX"], bwd[0].flags["COMPUTE_DW"], bwd[0].flags["COMPUTE_DB"]) == (True, False, True)
assert [n for n, _, _ in bwd[0].partial_buffers] == ["DB_PART"]
table(rows)
