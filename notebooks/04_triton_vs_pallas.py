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
# # 04 · One op, four ways: Triton, Triton from Torch, Pallas, XLA
#
# **Question.** The JAX frontend has three implementations of each op (`implementation="triton"`,
# `"pallas"`, `"xla"`). How close does each come to the memory bandwidth on the H200, how much does a
# frozen weight save in each, and do they compute the same numbers?
#
# **Answer.** On the H200 (first figures, from the committed device-time results) Triton and Pallas
# run near the copy bandwidth in every mode and, in the backward, well above XLA and plain `jnp` under
# autodiff; Triton leads Pallas in most cases (the numbers are printed under the figure). A frozen
# weight saves backward time in nearly every implementation and case; XLA saves the largest share,
# because its full backward is the slowest. All four columns agree with the float64 reference within
# the tolerances, and Triton through JAX is bitwise equal to Triton through Torch (asserted below, in
# this run).
#
# The JAX frontend runs every op through one `jax.custom_vjp` (so one set of frozen semantics) over
# a choice of kernels, picked with `implementation=`. This notebook runs the same ops — RMSNorm,
# LayerNorm and the fused residual-add + RMSNorm, forward, full backward and frozen backward (weight
# and bias frozen, x and the residual trained) — four ways:
#
# | column | what runs |
# |---|---|
# | **triton (jax)** | `implementation="triton"`: the Triton kernels of `normkit/kernels/norm.py`, launched through `jax_triton.triton_call` on a GPU (on CPU: Triton's interpreter, from a `jax.pure_callback`) |
# | **triton (torch)** | the *same* Triton kernels through `torch_frontend` (only when torch imports) |
# | **pallas** | `implementation="pallas"`: the Pallas kernel bodies of `normkit/kernels/norm_pallas.py` through `pallas_call` (on CPU: interpret mode) |
# | **xla** | `implementation="xla"`: plain `jax.numpy` in `jax_frontend/_xla.py`, fused by XLA |
#
# **Pallas lowers through Pallas-Triton on the GPU**, not Mosaic GPU: a memory-bound row norm keeps a
# whole row in one program's registers with masked loads and stores (any N), which is the shape of code
# Pallas's Triton lowering produces; Mosaic GPU stages blocks through shared memory with TMA (16-byte
# aligned rows, at most 256 elements a copy dimension) and has no masked loads, so it would need a
# different kernel body. JAX 0.11 deprecates the Triton lowering but still ships it. The reasons in full
# are in `jax_frontend/_pallas.py`'s docstring and the README's *JAX implementations* section.
#
# **Pallas is not bitwise equal to Triton** (README): the math and the rounding points are the same,
# but it is a different program — Pallas's lowering orders row reductions its own way and cannot turn
# off FMA contraction (the Triton LayerNorm backward launches with `enable_fp_fusion=False`). On the
# H200 the two agree within one bf16 ulp on y, dx and dW, and each is bitwise reproducible run to run.
# Triton through JAX and Triton through Torch *are* the same kernels with the same launch plans.
#
# Shown below: the code of each side by side; numerical agreement with the float64 reference
# (asserted: outputs and dx within `normkit.testing`'s tolerances, dW/dB too, and every gradient
# bitwise identical across two backward runs); the launch records of full vs frozen; median times,
# % of copy bandwidth under `benchmarks/bytemodel.py`'s byte model (GPU only) and what freezing saves.

# %%
import html
import importlib.util
import inspect
import json
import os
import warnings

import matplotlib.pyplot as plt
import numpy as np

# _nbutil first: it puts the repository on sys.path
from _nbutil import RESULTS_DIR, Source, display, environment, footnote, grouped_bars, notebook_size, show, table, this_run

import jax
import jax.numpy as jnp

import jax_frontend as nk
import normkit
from benchmarks import bytemodel
from benchmarks.timing import Timer, num_sets
from normkit.ops import OPS
from normkit.shapes import parse as parse_shape
from normkit.testing import TOLERANCES, assert_close, random_inputs

# jax 0.11 warns at every Pallas-Triton lowering that the backend is deprecated (see above): expected here.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
ON_GPU = jax.default_backend() == "gpu"
try:
    SIZE = notebook_size()
except ImportError:  # _nbutil asks torch whether CUDA is there; without torch, ask JAX
    SIZE = os.environ.get("NORMKIT_NOTEBOOK_SIZE") or ("full" if ON_GPU else "smoke")
# Accuracy runs on M x N, timing on TM x TN. smoke: tiny (the interpreters are slow). full: accuracy on
# 512 x 8192 (the float64 reference and the comparisons run on the host), timing on 8192 x 8192 (one
# bf16 array is 128 MiB: large enough that a call's time is the memory traffic, not the dispatch). The
# same N lets the Triton columns reuse their compiled kernels (M is not specialized on).
M, N = {"smoke": (64, 256), "full": (512, 8192)}[SIZE]
TM, TN = {"smoke": (64, 256), "full": (8192, 8192)}[SIZE]
# smoke: bf16 only (the interpreters are slow; tests/test_jax_implementations.py covers fp32 on CPU)
DTYPES = {"smoke": ["bfloat16"], "full": ["bfloat16", "float32"]}[SIZE]
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
JAX_DT = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
VARIANTS = ["full", "frozen"]  # full: every input trained; frozen: weight and bias frozen
print(f"size: {SIZE}; accuracy on {M} x {N}, timing on {TM} x {TN}; JAX backend: {jax.default_backend()}")
try:
    info = environment()
except ImportError:  # environment() reports torch's and Triton's versions too
    info = {"jax": jax.__version__, "jax devices": ", ".join(sorted({d.platform for d in jax.devices()}))}
display(table(list(info.items()), ["component", "version or device"]))

# %% [markdown]
# ## The answer on the H200: share of copy bandwidth, and what freezing saves
#
# From the committed device-time results (`benchmarks/device_time.py`, in
# `benchmarks/results/device_time/`): each call is built as `benchmarks/bench.py` builds it (a jitted
# forward; the backward as the vjp function of a separately jitted forward), traced with
# `jax.profiler`, and its **device busy time** (the sum of its GPU events) is turned into bandwidth under
# `benchmarks/bytemodel.py` (each input read once, each output written once) and divided by an XLA
# device copy's bandwidth traced the same way. `jnp` is a plain `jax.numpy` norm under JAX's own
# autodiff (no `custom_vjp`), the baseline a JAX user starts from. For each dtype, the figure uses the
# file with the most measurements (one sweep, not a mix of runs). Nothing here is measured where the
# notebook runs.

# %%
IMPL_LABELS = {"triton": "triton", "pallas": "pallas", "xla": "xla (normkit custom_vjp)", "jnp": "jnp (JAX autodiff)"}
IMPL_COLORS = {"triton": "black", "pallas": "tab:green", "xla": "tab:red", "jnp": "tab:gray"}
MODES = ["fwd", "bwd_full", "bwd_frozen"]
OP_TITLES = {"rms_norm": "RMSNorm", "layer_norm": "LayerNorm", "fused_add_rms_norm": "add+RMSNorm"}


def load_device_time(directory=RESULTS_DIR / "device_time"):
    """{dtype: (Source, [records])}: per dtype, the file with the most error-free records."""
    best = {}
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("dry_run") or not str(doc.get("schema", "")).startswith("normkit-device-time"):
            continue
        for dtype in {r["dtype"] for r in doc["records"]}:
            recs = [r for r in doc["records"] if r["dtype"] == dtype and not r.get("error") and r.get("pct_copy_device")]
            if len(recs) > len(best.get(dtype, (None, []))[1]):
                best[dtype] = (Source.of(path, doc), recs)
    return best


DEVICE_TIME = load_device_time()
dt_rows = [{"dtype": dtype, "shape": r["shape"], "op": r["op"], "mode": r["mode"], "impl": r["impl"],
            "device busy (µs)": r["device_busy_us"], "wall (µs)": r["wall_us"],
            "device bandwidth (% of copy)": r["pct_copy_device"]}
           for dtype, (_, recs) in DEVICE_TIME.items() for r in recs]
DT = table(dt_rows)
DT_SOURCES = {dtype: f"{dtype}: {src.label()}" for dtype, (src, _) in DEVICE_TIME.items()}
for dtype, (src, recs) in DEVICE_TIME.items():
    print(f"{len(recs)} records, {DT_SOURCES[dtype]}")


def shapes_of(dtype):
    return sorted(set(DT[DT["dtype"] == dtype]["shape"]), key=parse_shape)


if "bf16" in DEVICE_TIME:
    shapes_bf16 = shapes_of("bf16")
    impls = [i for i in IMPL_LABELS if i in set(DT["impl"])]
    fig, axes = plt.subplots(len(OPS), len(shapes_bf16), figsize=(4.6 * len(shapes_bf16), 3.1 * len(OPS)),
                             squeeze=False, sharey=True)
    for i, op in enumerate(OPS):
        for j, shape in enumerate(shapes_bf16):
            ax = axes[i][j]
            cell = DT[(DT["dtype"] == "bf16") & (DT["shape"] == shape) & (DT["op"] == op)].set_index(["impl", "mode"])
            pct = cell["device bandwidth (% of copy)"]
            grouped_bars(ax, MODES, {IMPL_LABELS[k]: [pct.get((k, m)) for m in MODES] for k in impls},
                         colors={IMPL_LABELS[k]: IMPL_COLORS[k] for k in impls}, annotate="{:.0f}", headroom=1.0)
            ax.axhline(100, color="0.4", lw=0.8, ls=":")
            ax.set_ylim(0, 125)
            ax.set_title(f"{OP_TITLES[op]} · {shape.replace('x', ' x ')}", fontsize=10)
            if j == 0:
                ax.set_ylabel("device bandwidth (% of copy)")
            if i == len(OPS) - 1:
                ax.set_xlabel("mode")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Share of copy bandwidth per implementation, bf16 (higher is better; dotted: a copy)", y=1.03)
    fig.tight_layout()
    footnote(fig, "Committed results, " + DT_SOURCES["bf16"])
    show(fig)
    pct = DT[DT["dtype"] == "bf16"].pivot_table(index=["shape", "op", "mode"], columns="impl",
                                                values="device bandwidth (% of copy)")
    for k in impls:
        print(f"bf16, {IMPL_LABELS[k]}: {pct[k].min():.0f} to {pct[k].max():.0f}% of copy (median {pct[k].median():.0f}%)")
    if {"triton", "pallas"} <= set(pct.columns):
        print(f"triton ahead of pallas in {int((pct['triton'] > pct['pallas']).sum())} of {len(pct)} bf16 cases")

if dt_rows:
    dtypes_dt = [d for d in ("bf16", "fp32") if d in DEVICE_TIME]
    ncols = max(len(shapes_of(d)) for d in dtypes_dt)
    fig, axes = plt.subplots(len(dtypes_dt), ncols, figsize=(4.6 * ncols, 3.2 * len(dtypes_dt)), squeeze=False,
                             sharey=True)
    saving_dt = []
    for i, dtype in enumerate(dtypes_dt):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(shapes_of(dtype)):
                ax.axis("off")
                continue
            shape = shapes_of(dtype)[j]
            cell = DT[(DT["dtype"] == dtype) & (DT["shape"] == shape)].set_index(["impl", "op", "mode"])["device busy (µs)"]
            impls = [k for k in IMPL_LABELS if any(key[0] == k for key in cell.index)]
            saved = {}
            for k in impls:
                saved[k] = []
                for op in OPS:
                    full, frozen = cell.get((k, op, "bwd_full")), cell.get((k, op, "bwd_frozen"))
                    pct = None if not (full and frozen) else 100 * (1 - frozen / full)
                    saved[k].append(pct)
                    saving_dt.append({"dtype": dtype, "shape": shape, "op": op, "impl": k, "full backward (µs)": full,
                                      "frozen backward (µs)": frozen, "saved by freezing (%)": pct})
            grouped_bars(ax, [OP_TITLES[op] for op in OPS], {IMPL_LABELS[k]: v for k, v in saved.items()},
                         colors={IMPL_LABELS[k]: IMPL_COLORS[k] for k in impls}, annotate="{:.0f}", headroom=1.0)
            ax.axhline(0, color="black", lw=0.6)
            ax.set_title(f"{dtype} · {shape.replace('x', ' x ')}", fontsize=10)
            if j == 0:
                ax.set_ylabel("backward device time saved\nby a frozen weight (%)")
    top = max((r["saved by freezing (%)"] or 0) for r in saving_dt)
    for ax in axes.flat:
        ax.set_ylim(min(0, *(r["saved by freezing (%)"] or 0 for r in saving_dt)) - 5, top * 1.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Frozen against full backward: device time saved per implementation (higher saves more)", y=1.04)
    fig.tight_layout()
    footnote(fig, "Committed results:\n" + "\n".join(DT_SOURCES.values()))
    show(fig)
    display(DT.pivot_table(index=["dtype", "shape", "op", "mode"], columns="impl",
                           values="device bandwidth (% of copy)", sort=False).round(0)
            .rename(columns=lambda k: f"{k} (% of copy)"))
    display(table(saving_dt).round(1))
else:
    print("No device-time results are committed (benchmarks/results/device_time/*.json): run "
          "`bash scripts/gpu-check.sh device-time` on the GPU machine and commit its JSON to draw these figures.")

# %% [markdown]
# ## Which columns can run here
#
# `jax_frontend.resolve_implementation(name)` raises, with the reason, when an implementation cannot
# run on this backend (it never falls back silently); such a column is skipped below, with that reason.

# %%
if HAVE_TORCH:
    import torch

    import torch_frontend as tf

    TORCH_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    TORCH_DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}

HOW = {
    "triton (jax)": "Triton kernels, jax-triton" if ON_GPU else "Triton kernels, Triton's interpreter (pure_callback)",
    "triton (torch)": "Triton kernels, torch_frontend" + ("" if HAVE_TORCH and TORCH_DEVICE.type == "cuda"
                                                          else ", Triton's interpreter"),
    "pallas": "Pallas kernels, pallas_call " + ("(Pallas-Triton lowering)" if ON_GPU else "(interpret mode)"),
    "xla": "jax.numpy, XLA",
}
IMPL = {"triton (jax)": "triton", "pallas": "pallas", "xla": "xla"}  # column -> implementation=
SKIPPED = {}
for col, impl in IMPL.items():
    try:
        nk.resolve_implementation(impl)
    except RuntimeError as err:
        SKIPPED[col] = str(err)
if not HAVE_TORCH:
    SKIPPED["triton (torch)"] = "torch is not installed"
COLUMNS = [c for c in HOW if c not in SKIPPED]
for col, why in SKIPPED.items():
    print(f"skipping column {col!r}: {why}")
if not ON_GPU:
    print("No GPU for JAX: the Triton columns run in Triton's interpreter and Pallas in interpret mode.")
BASE = next(c for c in ("triton (jax)", "pallas", "xla") if c in COLUMNS)  # the column others are compared with
display(table([{"column": c, "runs": "yes" if c in COLUMNS else "skipped", "how": HOW[c], "why skipped": SKIPPED.get(c)}
               for c in HOW]))

# %% [markdown]
# ## The code, side by side
#
# The same forward, backward and dW reduction, as a Triton kernel (`@triton.jit`, pointer arithmetic,
# `tl.constexpr` flags), as a Pallas kernel body (Refs indexed by tile, static Python flags bound with
# `functools.partial`) and in `jax.numpy` (whole arrays; XLA picks the fusion). Each flag that is off
# (`COMPUTE_DW`, `HAS_RESIDUAL`, ...) removes its code at compile time in all three: that is what makes
# the frozen backward cheaper. The XLA backward simply never traces the dW sum.

# %%
from jax_frontend import _pallas, _xla  # noqa: E402
from normkit.kernels import norm as triton_kernels, norm_pallas  # noqa: E402


def source(fn) -> str:
    return inspect.getsource(getattr(fn, "fn", fn))  # a @triton.jit JITFunction keeps the function in .fn


class SideBySide:
    """Sources in columns (HTML in a notebook; one after the other as text)."""

    def __init__(self, items):
        self.items = [(title, source(fn)) for title, fn in items]

    def _repr_html_(self):
        cells = "".join(
            f"<td style='vertical-align:top;text-align:left'><b>{html.escape(t)}</b> ({s.count(chr(10))} lines)"
            f"<pre style='font-size:10px;line-height:1.25'>{html.escape(s)}</pre></td>" for t, s in self.items)
        return f"<table><tr>{cells}</tr></table>"

    def __repr__(self):
        return "\n".join(f"# ---- {t} ({s.count(chr(10))} lines)\n{s}" for t, s in self.items)


display(SideBySide([("Triton: norm.py norm_fwd_kernel", triton_kernels.norm_fwd_kernel),
                    ("Pallas: norm_pallas.py norm_fwd_kernel", norm_pallas.norm_fwd_kernel),
                    ("XLA: _xla.py forward", _xla.forward)]))

# %%
display(SideBySide([("Triton: norm.py norm_bwd_kernel", triton_kernels.norm_bwd_kernel),
                    ("Pallas: norm_pallas.py norm_bwd_kernel", norm_pallas.norm_bwd_kernel),
                    ("XLA: _xla.py backward", _xla.backward)]))

# %% [markdown]
# The full backward's dW/dB: Triton and Pallas write one fp32 partial row per program and sum the
# `[G, N]` partials column-wise in a fixed order (deterministic, no atomics); XLA sums over rows in the
# backward above. And how the Pallas kernels are compiled on a GPU: Pallas-Triton's compiler params
# (Mosaic GPU is refused, with the reason).

# %%
display(SideBySide([("Triton: norm.py partial_sum_kernel", triton_kernels.partial_sum_kernel),
                    ("Pallas: norm_pallas.py partial_sum_kernel", norm_pallas.partial_sum_kernel),
                    ("Pallas glue: _pallas.py _compiler_params", _pallas._compiler_params)]))
print(f"Pallas GPU lowering in use: {_pallas.GPU_LOWERING!r} (NORMKIT_PALLAS_LOWERING)")

# %% [markdown]
# ## Numerical agreement
#
# Fresh random inputs (`normkit.testing.random_inputs`, rounded to the dtype once) go through every
# column and through the float64 reference (`op.run_reference`: the op's float64 forward and closed-form
# backward). The cotangents are `dy` (and `ds` for the fused op's `residual_out`). The backward runs
# twice on the same saved forward: every gradient must come out bitwise identical (dW/dB are sums over
# the rows, reduced in a fixed order). Asserted for every column, op, dtype and variant:
#
# - y (and residual_out) and dx (and d residual) within `normkit.testing.TOLERANCES`, dW/dB too (atol
#   grown by √M, since they sum M rows);
# - frozen: no dW/dB at all (Torch: `.grad is None`; JAX: a symbolic zero, instantiated as zeros), and
#   the backward launch has `COMPUTE_DW=False`, no fp32 partial buffer and no reduction launch;
# - the two backward runs bitwise equal.

# %%
rng = np.random.default_rng(404)


def cotangent_names(op):
    return ("y", "residual_out") if op.has_residual else ("y",)


_PROGRAMS = {}


def jax_program(col, op, variant):
    """(forward, training forward -> (outputs, vjp_fn), backward (vjp_fn, cts) -> grads), jitted, over the
    op's inputs in ``op.inputs`` order; frozen: the parameters through ``jax_frontend.freeze``. Cached, so
    that the timing below reuses what the accuracy runs compiled."""
    key = (col, op.name, variant)
    if key not in _PROGRAMS:
        fn = getattr(nk, op.name)

        def f(*args):
            kw = dict(zip(op.inputs, args))
            if variant == "frozen":
                kw.update(nk.freeze({p: kw[p] for p in op.params}, False))  # stop_gradient on every parameter
            out = fn(*(kw[n] for n in op.inputs), eps=op.default_eps, implementation=IMPL[col])
            return tuple(out) if op.has_residual else (out,)

        _PROGRAMS[key] = (jax.jit(f), jax.jit(lambda *a: jax.vjp(f, *a)), jax.jit(lambda vjp_fn, ct: vjp_fn(ct)))
    return _PROGRAMS[key]


def as_np(a):
    return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), dtype=np.float64)


def run_jax(col, op, dtype, variant, inp):
    """(outputs, gradients of run 1, gradients of run 2, launch record) by name, as float64 NumPy."""
    arr = {k: jnp.asarray(v, jnp.float32).astype(JAX_DT[dtype]) for k, v in inp.items()}
    _, fwd_train, bwd = jax_program(col, op, variant)
    cts = (arr["dy"],) + ((arr["ds"],) if op.has_residual else ())
    with normkit.record_launches() as log:  # under jit a launch is recorded when it is traced
        outs, vjp_fn = fwd_train(*(arr[k] for k in op.inputs))
        g1 = jax.block_until_ready(bwd(vjp_fn, cts))
    g2 = jax.block_until_ready(bwd(vjp_fn, cts))  # the same compiled backward, run again
    return (dict(zip(op.outputs, map(as_np, outs))), dict(zip(op.inputs, map(as_np, g1))),
            dict(zip(op.inputs, map(as_np, g2))), log)


def run_torch(op, dtype, variant, inp):
    t = {k: torch.from_numpy(v).to(TORCH_DEVICE, TORCH_DT[dtype]) for k, v in inp.items()}
    wrt = [k for k in op.inputs if variant == "full" or k not in op.params]
    for k in op.inputs:
        t[k].requires_grad_(k in wrt)
    with normkit.record_launches() as log:
        outs = getattr(tf, op.name)(*(t[k] for k in op.inputs), eps=op.default_eps)
        outs = tuple(outs) if op.has_residual else (outs,)
        cts = [t["dy"]] + ([t["ds"]] if op.has_residual else [])
        g1 = torch.autograd.grad(outs, [t[k] for k in wrt], cts, retain_graph=True)
    g2 = torch.autograd.grad(outs, [t[k] for k in wrt], cts)  # the same saved graph, backward again
    tn = lambda a: None if a is None else a.detach().double().cpu().numpy()  # noqa: E731
    grads = [{k: None for k in op.inputs} | {k: tn(g) for k, g in zip(wrt, gs)} for gs in (g1, g2)]
    return {k: tn(o) for k, o in zip(op.outputs, outs)}, grads[0], grads[1], log


def run(col, op, dtype, variant, inp):
    return run_torch(op, dtype, variant, inp) if col == "triton (torch)" else run_jax(col, op, dtype, variant, inp)


def tol_share(actual, expected, dtype, reduced_over=1):
    """max |actual - expected| / (atol * sqrt(reduced_over) + rtol * |expected|): below 1 passes."""
    tol = TOLERANCES[dtype]
    return float(np.max(np.abs(actual - expected) / (tol["atol"] * np.sqrt(reduced_over) + tol["rtol"] * np.abs(expected))))


MANTISSA = {"bfloat16": 7, "float32": 23}


def max_ulps(a, b, dtype):
    """max |a - b| in units in the last place of ``dtype`` at the largest |b| of the array (per element
    ulps would blow up where a row's sum cancels to nearly zero)."""
    scale = max(float(np.max(np.abs(b))), float(np.finfo(np.float32).tiny))
    return float(np.max(np.abs(a - b)) / 2.0 ** (np.floor(np.log2(scale)) - MANTISSA[dtype]))


def bwd_launch(log):
    (launch,) = [entry for entry in log if entry.kernel in ("norm_bwd_kernel", "xla_norm_bwd")]
    return launch


RESULTS, AGREE, LAUNCH_ROWS = {}, [], []
for op in OPS.values():
    for dtype in DTYPES:
        inp = random_inputs(op, (M, N), dtype, rng)
        ref_outs, ref_grads = op.run_reference(inp, op.options(eps=op.default_eps),
                                               {"y": inp["dy"], "residual_out": inp.get("ds")})
        for variant in VARIANTS:
            for col in COLUMNS:
                outs, grads, again, log = run(col, op, dtype, variant, inp)
                RESULTS[col, op.name, dtype, variant] = (outs, grads)
                what = f"{col} {op.name} {dtype} {variant}"
                row = {"column": col, "op": op.name, "dtype": dtype, "variant": variant}
                for k, r in ref_outs.items():
                    assert_close(outs[k], r, dtype, f"{what}: {k}")
                    row[k] = tol_share(outs[k], r, dtype)
                for k, r in ref_grads.items():
                    if k in op.params and variant == "frozen":
                        assert grads[k] is None or not np.any(grads[k]), f"{what}: d{k} of a frozen {k}"
                        row["d" + k] = "frozen"
                        continue
                    reduced = M if k in op.params else 1
                    assert_close(grads[k], r, dtype, f"{what}: d{k}", reduced_over=reduced)
                    row["d" + k] = tol_share(grads[k], r, dtype, reduced)
                for k in op.inputs:  # two backward runs, bitwise the same
                    a, b = grads[k], again[k]
                    assert (a is None and b is None) or np.array_equal(a, b), f"{what}: d{k} differs between runs"
                row["2 runs bitwise equal"] = True
                AGREE.append(row)
                # The launch record: frozen means no dW/dB work, no partial buffer, no reduction.
                launch = bwd_launch(log)
                full = variant == "full"
                assert launch.flags["COMPUTE_DW"] == full, what
                assert launch.flags["COMPUTE_DB"] == (full and "bias" in op.params), what
                assert bool(launch.partial_buffers) == (full and launch.implementation != "xla"), what
                assert bool(log.of("partial_sum_kernel")) == (full and launch.implementation != "xla"), what
                LAUNCH_ROWS.append({"column": col, "op": op.name, "dtype": dtype, "variant": variant,
                                    "implementation": launch.implementation,
                                    "backward launches": " → ".join(e.kernel for e in log
                                                                    if e.kernel not in ("norm_fwd_kernel", "xla_norm_fwd")),
                                    "DW": launch.flags["COMPUTE_DW"], "DB": launch.flags["COMPUTE_DB"],
                                    "fp32 partials (bytes)": launch.partial_bytes, "interpreted": launch.interpreted})
print(f"{len(AGREE)} runs checked: {len(COLUMNS)} columns x {len(OPS)} ops x {len(DTYPES)} dtypes x "
      f"{len(VARIANTS)} variants; all within tolerance, all gradients bitwise equal across two runs")

# %% [markdown]
# Share of the tolerance used, `max |actual − ref| / (atol·scale + rtol·|ref|)` (below 1 passes; scale
# is √M for dW and dB). Columns name the output (`y`, `residual_out`) or the gradient (`dx`, ...).

# %%
TOL_COLUMNS = ["y", "residual_out", "dx", "dresidual", "dweight", "dbias", "2 runs bitwise equal"]
display(table(AGREE, ["column", "op", "dtype", "variant"] + TOL_COLUMNS)
        .rename(columns={k: f"{k} (share of tolerance)" for k in TOL_COLUMNS[:-1]}))

# %% [markdown]
# ### Against each other
#
# Each column against the base column (triton (jax) where it runs): the largest difference, in units in
# the last place of the dtype at the array's largest magnitude, and how many of the arrays are bitwise
# equal. Triton through JAX and through Torch run the same kernels with the same launch plans: they
# must agree bitwise (asserted, when both run on the same kind of device). Pallas is a different program
# (see the top of the notebook) and XLA fuses its own way: small differences there are expected, within
# the tolerances asserted above. Those are displayed, not asserted (the README's "within one bf16 ulp"
# is an H200 measurement; the interpreters order their sums differently).

# %%
CROSS = []
for (col, name, dtype, variant), (outs, grads) in RESULTS.items():
    if col == BASE:
        continue
    base_outs, base_grads = RESULTS[BASE, name, dtype, variant]
    row, same, n = {"column": col, "vs": BASE, "op": name, "dtype": dtype, "variant": variant}, 0, 0
    for k, a, b in [(k, outs[k], base_outs[k]) for k in outs] + [("d" + k, grads[k], base_grads[k]) for k in grads]:
        if a is None or b is None or (k[1:] in OPS[name].params and variant == "frozen"):
            continue
        row[k] = max_ulps(a, b, dtype)
        same, n = same + bool(np.array_equal(a, b)), n + 1
    row["bitwise equal"] = f"{same}/{n}"
    CROSS.append(row)
    if {col, BASE} == {"triton (torch)", "triton (jax)"} and ON_GPU == (TORCH_DEVICE.type == "cuda"):
        assert same == n, f"triton through torch and through jax differ: {row}"
CROSS_TABLE = table(CROSS, ["column", "vs", "op", "dtype", "variant"] + TOL_COLUMNS[:-1] + ["bitwise equal"])
cross_cols = [k for k in TOL_COLUMNS[:-1] if k in CROSS_TABLE]
CROSS_TABLE["largest difference (ulps)"] = CROSS_TABLE[cross_cols].max(axis=1)
if CROSS:
    others = [c for c in COLUMNS if c != BASE]
    groups = [f"{OP_TITLES[op]}\n{SHORT[dt]}" for op in OPS for dt in DTYPES]
    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(13, 3.8), sharey=True)
    for ax, variant in zip(axes, VARIANTS):
        sel = CROSS_TABLE[CROSS_TABLE["variant"] == variant].set_index(["column", "op", "dtype"])["largest difference (ulps)"]
        grouped_bars(ax, groups, {c: [sel.get((c, op, dt)) for op in OPS for dt in DTYPES] for c in others},
                     colors={"triton (torch)": "tab:blue", "pallas": "tab:green", "xla": "tab:red"})
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(0, 1e3)
        ax.set_title(f"{variant} backward", fontsize=10)
        ax.set_xlabel("op and dtype")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(title=f"against {BASE}", fontsize=7, ncol=3, loc="upper center")
    axes[0].set_ylabel("largest difference of y and the gradients\n(ulps of the dtype; 0 = bitwise equal)")
    fig.suptitle(f"The implementations against {BASE}, at {M} x {N}")
    fig.tight_layout()
    footnote(fig, this_run(SIZE, "computed in this run") + ".\nDifferences are arithmetic, not speed; every "
             "column is within the float64 reference's tolerance (asserted above).")
    show(fig)
display(CROSS_TABLE.rename(columns={k: f"{k} (ulps)" for k in cross_cols} | {"bitwise equal": "bitwise equal (arrays)"}))

# %% [markdown]
# ## What freezing changes in the backward
#
# The launch records of the bf16 runs (the variants do not depend on the dtype): which backward
# launches ran, with which flags, and the fp32 partial-dW/dB bytes they wrote. The frozen backward of
# every implementation skips dW/dB; Triton and Pallas also skip the partial buffer and the reduction.

# %%
display(table([r for r in LAUNCH_ROWS if r["dtype"] == "bfloat16"],
              ["column", "op", "variant", "implementation", "backward launches", "DW", "DB", "fp32 partials (bytes)",
               "interpreted"]))

# %% [markdown]
# ## Time, bandwidth and frozen savings
#
# Each column is timed the same way, end to end as a network calls it: the forward under `jax.jit`
# (Torch: under `no_grad`), the backward as the vjp function of a separately jitted forward (Torch:
# `autograd.grad` of a saved graph). On a GPU: `benchmarks.timing.Timer.loop` (blocks of back-to-back
# calls, one sync per block, median over blocks), input sets rotated past the L2 as `benchmarks/bench.py`
# does, and % of copy = the byte model's bytes (`benchmarks/bytemodel.py`: each input read once, each
# output written once; fp32 partials not counted) per second over a device-to-device copy's bandwidth
# measured here (`Timer.copy_bandwidth`). On CPU: `Timer(dry=True)`, one wall-clock call after two
# warm-up calls, bf16 only: it runs the code path and says nothing about speed.

# %%
GPU_TIMING = ON_GPU
COPY = None
timer = Timer(warmup_ms=5, rep_ms=50, dry=not GPU_TIMING)
if ON_GPU and HAVE_TORCH and torch.cuda.is_available():
    COPY = timer.copy_bandwidth()
    print(f"copy bandwidth: {COPY['tbps']:.2f} TB/s ({COPY['what']})")
elif ON_GPU:
    print("no torch with CUDA here: no copy-bandwidth measurement, so no % of copy below")
else:
    print("CPU: the times below mean NOTHING about GPU performance (Triton and Pallas run in interpreters "
          "here; wall clock of one call, bf16 only). % of copy is shown on a GPU only.")
TIME_DTYPES = DTYPES if GPU_TIMING else DTYPES[:1]
if not HAVE_TORCH:  # benchmarks.timing times calls through torch.utils.benchmark
    TIME_DTYPES = []
    print("torch is not installed: nothing is timed here (benchmarks.timing needs torch)")


def jax_sets(op, dtype, k, seed=0):
    """k input sets (positional args in op.inputs order) and cotangents, made on the device."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 * k + 2))
    dt = JAX_DT[dtype]
    params = {"weight": (1.0 + 0.1 * jax.random.normal(next(keys), (TN,))).astype(dt),
              "bias": (0.1 * jax.random.normal(next(keys), (TN,))).astype(dt)}
    sets = []
    for _ in range(k):
        acts = {"x": jax.random.normal(next(keys), (TM, TN)).astype(dt),
                "residual": jax.random.normal(next(keys), (TM, TN)).astype(dt)}
        cts = tuple(jax.random.normal(next(keys), (TM, TN)).astype(dt) for _ in cotangent_names(op))
        sets.append((tuple({**acts, **params}[n] for n in op.inputs), cts))
    return sets


def time_jax(col, op, dtype, mode, k):
    fwd, fwd_train, bwd = jax_program(col, op, "frozen" if mode == "bwd_frozen" else "full")
    sets = jax_sets(op, dtype, k)
    sync = jax.block_until_ready
    if mode == "fwd":
        sync(fwd(*sets[0][0]))
        return timer.loop(lambda i: fwd(*sets[i % k][0]), sync)
    saved = [fwd_train(*args)[1] for args, _ in sets]
    sync(bwd(saved[0], sets[0][1]))
    return timer.loop(lambda i: bwd(saved[i % k], sets[i % k][1]), sync)


def time_torch(op, dtype, mode, k):
    dt, dev = TORCH_DT[dtype], TORCH_DEVICE
    fn = getattr(tf, op.name)
    params = {"weight": 1.0 + 0.1 * torch.randn(TN, device=dev).to(dt), "bias": 0.1 * torch.randn(TN, device=dev).to(dt)}
    wrt = [n for n in op.inputs if mode == "bwd_full" or n not in op.params]
    sets = []
    for _ in range(k):
        t = {**params, "x": torch.randn(TM, TN, device=dev).to(dt), "residual": torch.randn(TM, TN, device=dev).to(dt)}
        t = {n: t[n].detach().requires_grad_(mode != "fwd" and n in wrt) for n in op.inputs}
        sets.append((t, [torch.randn(TM, TN, device=dev).to(dt) for _ in cotangent_names(op)]))
    sync = (lambda _: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda _: None)
    if mode == "fwd":
        def call(i):
            with torch.no_grad():
                return fn(*sets[i % k][0].values(), eps=op.default_eps)
    else:
        graphs = [fn(*t.values(), eps=op.default_eps) for t, _ in sets]

        def call(i):
            t, cts = sets[i % k]
            outs = graphs[i % k]
            return torch.autograd.grad(tuple(outs) if op.has_residual else (outs,), [t[n] for n in wrt], cts,
                                       retain_graph=True)
    sync(call(0))
    return timer.loop(call, sync)


TIMES = {}
for op in OPS.values():
    for dtype in TIME_DTYPES:
        item = {"bfloat16": 2, "float32": 4}[dtype]
        k = num_sets((4 if op.has_residual else 2) * TM * TN * item) if GPU_TIMING else 1
        for col in COLUMNS:
            for mode in MODES:
                TIMES[col, op.name, dtype, mode] = (time_torch(op, dtype, mode, k) if col == "triton (torch)"
                                                    else time_jax(col, op, dtype, mode, k))
    if GPU_TIMING and HAVE_TORCH and torch.cuda.is_available():
        torch.cuda.empty_cache()
print(f"{len(TIMES)} timings on {TM} x {TN} ({'GPU' if GPU_TIMING else 'CPU wall clock: meaningless for performance'})")


def pct_copy(op, dtype, mode, us):
    if COPY is None:
        return None
    nbytes = bytemodel.bytes_moved(op, mode, TM, TN, {"bfloat16": 2, "float32": 4}[dtype])
    return 100 * nbytes / (us * 1e-6) / 1e12 / COPY["tbps"]


rows = []
for (col, name, dtype, mode), us in TIMES.items():
    rows.append({"op": name, "dtype": SHORT[dtype], "mode": mode, "column": col, "time (µs)": us,
                 "bandwidth (% of copy)": pct_copy(name, dtype, mode, us),
                 f"time / {BASE} (x)": us / TIMES[BASE, name, dtype, mode]})
rows.sort(key=lambda r: (list(OPS).index(r["op"]), r["dtype"], MODES.index(r["mode"]), COLUMNS.index(r["column"])))
HERE = table(rows)

saving_rows = []
for op in OPS.values():
    for dtype in TIME_DTYPES:
        item = {"bfloat16": 2, "float32": 4}[dtype]
        for col in COLUMNS:
            full, frozen = TIMES[col, op.name, dtype, "bwd_full"], TIMES[col, op.name, dtype, "bwd_frozen"]
            saving_rows.append({"op": op.name, "dtype": SHORT[dtype], "column": col, "full backward (µs)": full,
                                "frozen backward (µs)": frozen, "saved by freezing (%)": 100 * (1 - frozen / full),
                                "byte model: dW/dB bytes saved (bytes)":
                                    bytemodel.bytes_moved(op.name, "bwd_full", TM, TN, item)
                                    - bytemodel.bytes_moved(op.name, "bwd_frozen", TM, TN, item)})
SAVED_HERE = table(saving_rows)

if TIMES:
    COLUMN_COLORS = {"triton (jax)": "black", "triton (torch)": "tab:blue", "pallas": "tab:green", "xla": "tab:red"}
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(15, 4), gridspec_kw={"width_ratios": [3, 2]})
    value = "bandwidth (% of copy)" if COPY else "time (µs)"
    cell = HERE[HERE["dtype"] == "bf16"].set_index(["column", "op", "mode"])[value]
    if not COPY:
        ax_b.set_yscale("log")
    grouped_bars(ax_b, [f"{OP_TITLES[op]}\n{mode}" for op in OPS for mode in MODES],
                 {c: [cell.get((c, op, mode)) for op in OPS for mode in MODES] for c in COLUMNS}, colors=COLUMN_COLORS)
    ax_b.set_ylabel("bandwidth (% of copy)" if COPY else "wall time per call (µs)")
    ax_b.set_title("bf16, " + ("higher is better" if COPY else "interpreter wall clock: says nothing about speed"),
                   fontsize=10)
    if COPY:
        ax_b.axhline(100, color="0.4", lw=0.8, ls=":")
    ax_b.set_xlabel("op and mode")
    ax_b.tick_params(axis="x", labelsize=7)
    cell = SAVED_HERE.set_index(["column", "op", "dtype"])["saved by freezing (%)"]
    grouped_bars(ax_s, [f"{OP_TITLES[op]}\n{SHORT[dt]}" for op in OPS for dt in TIME_DTYPES],
                 {c: [cell.get((c, op, SHORT[dt])) for op in OPS for dt in TIME_DTYPES] for c in COLUMNS},
                 colors=COLUMN_COLORS)
    ax_s.axhline(0, color="black", lw=0.6)
    ax_s.set_ylabel("backward time saved by freezing (%)")
    ax_s.set_title("Frozen against full backward" + ("" if COPY else ", interpreter wall clock"), fontsize=10)
    ax_s.set_xlabel("op and dtype")
    ax_s.tick_params(axis="x", labelsize=7)
    handles, labels = ax_b.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"The {len(COLUMNS)} columns timed in this run, {TM} x {TN}", y=1.06)
    fig.tight_layout()
    footnote(fig, this_run(SIZE, "timed in this run") + ("" if COPY else ".\nThe answer on the GPU is the first "
                                                           "figures, from the committed device-time results."))
    show(fig)
display(HERE)

# %% [markdown]
# ### Frozen vs full backward
#
# Time of the frozen backward against the full one, per column (`saved` = 1 − frozen / full), and the
# byte model's difference (the dW/dB writes only: the fp32 partials the full backward also writes and
# reads back are not in the model, see the launch records above for their size).

# %%
display(SAVED_HERE)

# %% [markdown]
# Reading the GPU numbers: Triton through JAX and through Torch are the same kernels on the same grids,
# so a difference between those two columns is the frontends' dispatch. Pallas's lowering emits code of
# the same shape as the Triton kernel (one row block per program, masked loads), but Pallas does not
# pipeline the full backward's persistent tile loop for it (the kernel body prefetches the next tile by
# hand). The README quotes the H200 figures (bf16): Pallas forward at 95-97% of copy for RMSNorm
# (74-93% LayerNorm), frozen backward 93-96%, full backward 1.44-2.2x faster than XLA.
# `benchmarks/bench.py --peers jax-impls,xla` measures the same comparison on every benchmark shape; its
# report has a "JAX implementations: Triton vs Pallas vs XLA" section (`benchmarks/results/h200.md`).
