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
# **Question.** In LoRA/PEFT fine-tuning the norms' weights are frozen. What does normkit's backward
# then leave out, what does that save in time and memory, and are the gradients still right, for every
# op and through both frontends?
#
# **Answer.** Frozen, the backward runs one kernel instead of two: the variant with `COMPUTE_DW=False`,
# with no fp32 partial buffer and no `partial_sum_kernel` reduction. On the H200 that makes the
# backward faster for all three ops through both frontends, and lowers its peak memory by the partial
# buffers and dW/dB in all but one case (first figure, from the committed benchmark). The gradients
# that remain (dx, and the fused op's d residual) are within the float64 reference's tolerance and
# agree between Torch and JAX (last figures, computed in this run).
#
# How each part is made:
#
# 1. the committed H200 benchmark (`benchmarks/results/h200.json`): backward time and peak memory,
#    full against frozen, per op and frontend;
# 2. this run: every op (RMSNorm, LayerNorm, fused residual-add + RMSNorm) through both frontends,
#    once with every parameter trained (*full*) and once with the parameters frozen (*frozen*): the
#    launch record (which kernel variant ran, which partial buffers were allocated), gradient agreement
#    with the float64 reference (`normkit.reference`) and between the frontends;
# 3. the `jax_frontend.freeze` mask pattern on a small parameter tree.
#
# In Torch a parameter is frozen with `requires_grad=False` (the autograd Function reads
# `ctx.needs_input_grad`); in JAX with `jax_frontend.freeze(params, trainable)` inside the loss, which
# applies `stop_gradient`, seen by the `custom_vjp` as an unperturbed input.

# %%
# _nbutil first: it puts the repository on sys.path
from _nbutil import RESULTS_DIR, Source, display, environment, footnote, grouped_bars, notebook_size, show, table, this_run

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import torch

import jax_frontend as nk
import normkit
import torch_frontend as tf
from normkit.ops import OPS
from normkit.testing import TOLERANCES, assert_close, random_inputs

SIZE = notebook_size()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# full: Llama-3-8B's hidden size, 2048 tokens (the float64 reference and the comparisons run on the host)
M, N = {"smoke": (48, 256), "full": (2048, 4096)}[SIZE]
DTYPES = ["float32", "bfloat16"]
VARIANTS = ["full", "frozen"]  # full: parameters trained; frozen: parameters frozen. x is trained in both.
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
JAX_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
OP_TITLES = {"rms_norm": "RMSNorm", "layer_norm": "LayerNorm", "fused_add_rms_norm": "add+RMSNorm"}
COLORS = {"full": "tab:red", "frozen": "tab:blue"}
SERIES_COLORS = {f"{fe}, {v}": COLORS[v] for fe in ("torch", "jax") for v in VARIANTS}
SERIES_HATCHES = {f"jax, {v}": "//" for v in VARIANTS}
print(f"size: {SIZE}; x is {M} x {N}")
display(table(list(environment().items()), ["component", "version or device"]))

# %% [markdown]
# ## The answer on the H200: backward time and memory, full against frozen
#
# From the committed benchmark (`benchmarks/bench.py`), bf16 at 8192 x 8192: one backward call through
# each frontend's public API (Torch: `torch.autograd.grad`; JAX: the vjp function of a separately
# jitted forward), median wall time of back-to-back calls; peak memory is Torch's
# `max_memory_allocated` delta of the call (outputs included) and, for JAX, XLA's memory analysis of
# the compiled backward. Nothing in this figure is measured where the notebook runs.

# %%
BENCH = Path(os.environ.get("NORMKIT_BENCH_RESULTS") or RESULTS_DIR / "h200.json")
BENCH_SHAPE, BENCH_DTYPE = "8192x8192", "bf16"
FRONTEND_IMPLS = {"torch": ("normkit", "e2e"), "jax": ("normkit_jax", "e2e")}
bench_rows = []
if BENCH.exists():
    bench_doc = json.loads(BENCH.read_text())
    BENCH_SOURCE = Source.of(BENCH, bench_doc)
    rec = {(r["op"], r["mode"], r["impl"], r["path"]): r for r in bench_doc["records"]
           if r["shape"] == BENCH_SHAPE and r["dtype"] == BENCH_DTYPE and r.get("median_us") and not r.get("error")}
    for op in OPS:
        for fe, impl in FRONTEND_IMPLS.items():
            full, frozen = rec.get((op, "bwd_full", *impl)), rec.get((op, "bwd_frozen", *impl))
            if not (full and frozen):
                continue
            mib = lambda r: None if r.get("peak_mem_bytes") is None else r["peak_mem_bytes"] / 2**20  # noqa: E731
            kernel = rec.get((op, "bwd_full", "normkit", "kernel")) or {}
            bench_rows.append({
                "op": op, "frontend": fe,
                "full backward (µs)": full["median_us"], "frozen backward (µs)": frozen["median_us"],
                "time saved (%)": 100 * (1 - frozen["median_us"] / full["median_us"]),
                "full peak memory (MiB)": mib(full), "frozen peak memory (MiB)": mib(frozen),
                "fp32 partials of the full backward (MiB)": (kernel.get("extra") or {}).get("partial_bytes", 0) / 2**20
                if fe == "torch" and kernel else None,
            })
    print(f"source: {BENCH_SOURCE.label()}")
else:
    print(f"{BENCH} is absent: run benchmarks/bench.py on a GPU and commit its JSON to draw this figure.")
BENCH_TABLE = table(bench_rows)

if bench_rows:
    by = {(r["op"], r["frontend"]): r for r in bench_rows}
    ops = [op for op in OPS if any(k[0] == op for k in by)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    grouped_bars(ax_t, [OP_TITLES[op] for op in ops],
                 {f"{fe}, {v}": [by.get((op, fe), {}).get(f"{v} backward (µs)") for op in ops]
                  for fe in FRONTEND_IMPLS for v in VARIANTS},
                 colors=SERIES_COLORS, hatches=SERIES_HATCHES, annotate="{:.0f}")
    ax_t.set_ylabel("backward time per call (µs)")
    ax_t.set_title("Backward time, full vs frozen weight (lower is better)", fontsize=10)
    ax_t.legend(fontsize=8, ncol=4, loc="upper center")
    grouped_bars(ax_m, [OP_TITLES[op] for op in ops],
                 {fe: [None if (r := by.get((op, fe))) is None or r["full peak memory (MiB)"] is None
                       else r["full peak memory (MiB)"] - r["frozen peak memory (MiB)"] for op in ops]
                  for fe in FRONTEND_IMPLS},
                 colors={"torch": "tab:gray", "jax": "tab:purple"}, annotate="{:.1f}")
    ax_m.set_ylabel("peak memory saved by freezing (MiB per call)")
    ax_m.set_title("Memory the frozen backward does not allocate", fontsize=10)
    ax_m.legend(title="frontend", fontsize=8, ncol=2, loc="upper left")
    for ax in (ax_t, ax_m):
        ax.set_xlabel("op")
    fig.suptitle(f"Frozen vs full backward on the {BENCH_SOURCE.device}: normkit through torch and JAX, "
                 f"{BENCH_DTYPE} {BENCH_SHAPE.replace('x', ' x ')}")
    fig.tight_layout()
    footnote(fig, f"Committed results: {BENCH_SOURCE.label()}")
    show(fig)
display(BENCH_TABLE.round(1))

# %% [markdown]
# Every op is a row of normkit's op table (`normkit.ops.OPS`): its inputs in signature order (the row
# inputs, then the parameters), its outputs and its default `eps`. The code below reads them from there
# and never tests an op's name; each public function takes the op's inputs positionally in that order.

# %%
display(table([{"op": op.name, "inputs": ", ".join(op.inputs), "row inputs": ", ".join(op.row_inputs),
                "parameters": ", ".join(op.params), "outputs": ", ".join(op.outputs), "default eps": op.default_eps}
               for op in OPS.values()]))

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
            row, same, n, worst = {"op": op.name, "dtype": dtype, "variant": variant}, 0, 0, 0.0
            for k in op.outputs + op.inputs:
                t, j = (t_outs[k], j_outs[k]) if k in op.outputs else (t_grads[k], j_grads[k])
                if t is None:
                    row[k] = "frozen"
                    continue
                assert_close(j, t, dtype, f"jax vs torch {op.name} {dtype} {variant}: {k}",
                             reduced_over=M if k in op.params else 1)
                row[k] = float(np.max(np.abs(t - j)))
                worst = max(worst, tol_share(j, t, dtype, M if k in op.params else 1))
                same, n = same + bool(np.array_equal(t, j)), n + 1
            row["bitwise equal"] = f"{same}/{n}"
            row["worst share of tolerance"] = worst
            CROSS.append(row)
            del res
print(f"{len(AGREE)} runs: {len(FRONTENDS)} frontends x {len(OPS)} ops x {len(DTYPES)} dtypes x {len(VARIANTS)} variants")

# %% [markdown]
# ## 1. The launch record: which variant ran, what was allocated
#
# For each run, the backward launch's `COMPUTE_*` flags, its grid, the fp32 partial buffers it wrote
# (one row of N per program) and whether the `partial_sum_kernel` reduction ran. *Backward bytes* is a
# traffic model of the backward: read x and dy (and `ds`), write dx; with dW/dB also write the fp32
# partials, read them back in the reduction, and write dW/dB. These are properties of the launch plan
# at this run's shape and device, not timings: they mean the same on a CPU as on a GPU.

# %%
def fmt_partials(launch):
    return ", ".join(f"{name} {'x'.join(map(str, shape))} {dt}" for name, shape, dt in launch.partial_buffers) or "none"


def variant_flags(log):
    return [{k: v for k, v in launch.flags.items() if k != "REC_IN_RSTD"} for launch in log.of("norm_bwd_kernel")]


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
        "backward launches": " → ".join(k.removesuffix("_kernel") for k in log.kernels() if k != "norm_fwd_kernel"),
        "DX": f["COMPUTE_DX"], "DW": f["COMPUTE_DW"], "DB": f["COMPUTE_DB"], "bwd grid (programs)": bwd.grid[0],
        "partial buffers": fmt_partials(bwd), "fp32 partials (bytes)": bwd.partial_bytes,
        "backward traffic, model (bytes)": backward_bytes(op, dtype, log),
    })
    # The frozen variant must run without dW/dB work, partials or reduction; the full one with them.
    full = variant == "full"
    assert f["COMPUTE_DW"] == full and f["COMPUTE_DB"] == (full and "bias" in op.params)
    assert bool(bwd.partial_buffers) == full and bool(log.of("partial_sum_kernel")) == full
    # Torch's kernel variant (where the weight's recovery lies is each frontend's own: RSTD, or a buffer)
    assert variant_flags(log) == variant_flags(LOGS["torch", name, dtype, variant])

saving_rows = []
for fe in FRONTENDS:
    for op in OPS:
        by = {r["variant"]: r for r in launch_rows if r["frontend"] == fe and r["op"] == op}
        full, frozen = by["full"], by["frozen"]
        saving_rows.append({"frontend": fe, "op": op,
                            "backward launches full": len(full["backward launches"].split(" → ")),
                            "backward launches frozen": len(frozen["backward launches"].split(" → ")),
                            "fp32 partials full (KiB)": full["fp32 partials (bytes)"] / 2**10,
                            "fp32 partials frozen (KiB)": frozen["fp32 partials (bytes)"] / 2**10,
                            "backward traffic full (MiB)": full["backward traffic, model (bytes)"] / 2**20,
                            "backward traffic frozen (MiB)": frozen["backward traffic, model (bytes)"] / 2**20,
                            "traffic saved (%)": 100 * (1 - frozen["backward traffic, model (bytes)"]
                                                        / full["backward traffic, model (bytes)"])})

saved = {(r["frontend"], r["op"]): r for r in saving_rows}


def per_series(value):
    """{"torch, full": [value(row, "full") per op], ...} from the savings rows."""
    return {f"{fe}, {v}": [value(saved[fe, op], v) for op in OPS] for fe in FRONTENDS for v in VARIANTS}


fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(13, 4))
grouped_bars(ax_l, [OP_TITLES[op] for op in OPS], per_series(lambda r, v: r[f"backward launches {v}"]), colors=SERIES_COLORS,
             hatches=SERIES_HATCHES, annotate="{:.0f}")
ax_l.set_ylabel("kernel launches per backward call")
ax_l.set_yticks([0, 1, 2])
ax_l.set_title("Kernels the backward launches", fontsize=10)
grouped_bars(ax_p, [OP_TITLES[op] for op in OPS], per_series(lambda r, v: r[f"fp32 partials {v} (KiB)"]),
             colors=SERIES_COLORS, hatches=SERIES_HATCHES, annotate="{:.0f}")
ax_p.set_ylabel("fp32 partial buffers allocated (KiB per call)")
ax_p.set_title("fp32 partial dW/dB buffers the backward allocates", fontsize=10)
for ax in (ax_l, ax_p):
    ax.set_xlabel("op")
    ax.legend(title="frontend, norm weight", fontsize=8, ncol=4, loc="upper center")
fig.suptitle(f"What freezing removes from the backward: launch records at {M} x {N} (bf16)")
fig.tight_layout()
footnote(fig, this_run(SIZE, "launch records of this run") + ".\nLaunch counts and allocated bytes are "
         "properties of the launch plan, exact on any device; the partials' size depends on the grid.")
show(fig)
display(table(saving_rows).round(1))

# %% [markdown]
# The launch records themselves (bf16; the variants do not depend on the dtype). The partials scale with
# the number of programs, not with M, so at large M they are a small share of the bytes; there freezing
# mostly removes the dW accumulation work and the second launch (notebook 02).

# %%
display(table(launch_rows))

# %% [markdown]
# ## 2. Gradient agreement: with the float64 reference, and across the frontends
#
# The **share of the tolerance used** is `max |actual − ref| / (atol·scale + rtol·|ref|)`, with
# scale = √M for dW and dB (sums over M rows): below 1 passes (`normkit.testing.TOLERANCES`, asserted
# above for every array). Left: each frontend against the float64 reference, the worst array of each run.
# Right: Torch against JAX, measured with the same tolerance. Both frontends plan their launches with
# the same function (`normkit.launch`) and run the same kernels with the same flags, so they agree far
# more closely than either agrees with the reference.

# %%
TOL_COLUMNS = ["y", "residual_out", "x", "residual", "weight", "bias"]


def worst_share(row):
    return max(v for k, v in row.items() if k in TOL_COLUMNS and isinstance(v, float))


agree_groups = [f"{OP_TITLES[op]}\n{dt}" for op in OPS for dt in DTYPES]
agree = {(r["frontend"], r["op"], r["dtype"], r["variant"]): worst_share(r) for r in AGREE}
cross = {(r["op"], r["dtype"], r["variant"]): r for r in CROSS}


def bitwise_pct(row):
    same, n = map(int, row["bitwise equal"].split("/"))
    return 100 * same / n


fig, (ax_r, ax_x) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
grouped_bars(ax_r, agree_groups, {f"{fe}, {v}": [agree[fe, op, dt, v] for op in OPS for dt in DTYPES]
                                  for fe in FRONTENDS for v in VARIANTS}, colors=SERIES_COLORS, hatches=SERIES_HATCHES)
ax_r.axhline(1.0, color="black", lw=0.8, ls="--", label="tolerance")
ax_r.set_yscale("log")
ax_r.set_ylim(1e-4, 10)
ax_r.set_ylabel("largest share of the tolerance used (1 = at the limit)")
ax_r.set_title("Each frontend against the float64 reference (lower is closer)", fontsize=10)
ax_r.legend(fontsize=7, ncol=5, loc="upper center")
grouped_bars(ax_x, agree_groups, {v: [bitwise_pct(cross[op, dt, v]) for op in OPS for dt in DTYPES] for v in VARIANTS},
             colors=COLORS)
ax_x.set_ylim(0, 135)
ax_x.set_ylabel("outputs and gradients bitwise equal (%)")
ax_x.set_title("Torch against JAX: arrays bitwise equal", fontsize=10)
ax_x.legend(title="norm weight", fontsize=7, ncol=2, loc="upper center")
for ax in (ax_r, ax_x):
    ax.set_xlabel("op and dtype")
    ax.tick_params(axis="x", labelsize=8)
fig.suptitle(f"Gradient and output agreement at {M} x {N}: every run inside the tolerance")
fig.tight_layout()
footnote(fig, this_run(SIZE, "computed in this run") + ".\nAgreement is a property of the arithmetic, not "
         "of the speed.")
show(fig)

# %% [markdown]
# The numbers behind the left panel: one row per run, one column per output (`y`, `residual_out`) or per
# input whose gradient is compared (share of the tolerance used). Frozen parameters show *frozen*: Torch
# produced no gradient (`.grad is None`) and JAX a symbolic zero (instantiated as zeros by `jax.grad`).

# %%
display(table(AGREE, ["frontend", "op", "dtype", "variant"] + TOL_COLUMNS)
        .rename(columns={k: f"{k} (share of tolerance)" for k in TOL_COLUMNS}))

# %% [markdown]
# Behind the right panel: each cell is `max |torch − jax|` (absolute, in the array's units); the last
# columns count the arrays that are bitwise equal and give the worst share of the tolerance.

# %%
display(table(CROSS, ["op", "dtype", "variant"] + TOL_COLUMNS + ["bitwise equal", "worst share of tolerance"])
        .rename(columns={k: f"{k}: max |torch − jax|" for k in TOL_COLUMNS} | {"bitwise equal": "bitwise equal (arrays)"}))

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
                      "max |grad|": float(jnp.max(jnp.abs(g)))})
    assert bool(jnp.any(g != 0)) == is_trainable, name
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g2))  # the callable mask is the same mask
display(table(leaf_rows))

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
display(table(rows))
