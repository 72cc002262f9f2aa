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
# # 02 · Performance: normkit and its peers on the GPU
#
# **Question.** How fast are normkit's kernels against Liger, torch eager, torch.compile and XLA, as a
# share of what the memory system allows, and how much does a frozen weight speed up and shrink the
# backward?
#
# **Answer** (the figures below): at the large shapes (M ≥ 8192, N ≥ 4096) normkit's kernels run near
# the copy bandwidth, and its frozen backward is faster than its full one for every op; at the smallest
# shapes every library's call is bound by host time, not by the kernel. The tables under the figures
# give the medians.
#
# **Every figure in the first part is read from the committed benchmark results,
# `benchmarks/results/h200.json`**, written by `benchmarks/bench.py` on an NVIDIA H200. Nothing in
# that part is measured where this notebook runs, so the plots look the same on a laptop; each says
# under it which device, date and commit it comes from. The last cell re-measures a few shapes on the
# spot, and only when a CUDA GPU is present.
#
# Bandwidth is achieved bytes per second under the byte model of `benchmarks/bytemodel.py` (each input
# read once, each output written once; fp32 partials not counted), and *share of copy* divides it by a
# device-to-device copy's bandwidth measured in the same run.
#
# `NORMKIT_BENCH_RESULTS=path` reads another results file (the test suite uses this to exercise the
# plots on a synthetic file).

# %%
import json
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt

from _nbutil import ROOT, Source, display, environment, footnote, grouped_bars, notebook_size, show, table, this_run

SIZE = notebook_size()
RESULTS = Path(os.environ.get("NORMKIT_BENCH_RESULTS") or ROOT / "benchmarks" / "results" / "h200.json").resolve()
SHOWN = RESULTS.relative_to(ROOT) if RESULTS.is_relative_to(ROOT) else RESULTS
print(f"size: {SIZE}")
display(table(list(environment().items()), ["component", "version or device"]))

# %%
if RESULTS.exists():
    doc = json.loads(RESULTS.read_text())
    records = [r for r in doc.get("records", []) if r.get("median_us") and not r.get("error")]
    dev, ver, copy = doc.get("device", {}), doc.get("versions", {}), doc.get("copy", {})
    dry = any(run.get("dry_run") for run in doc.get("runs", []))
    errors = [r.get("error") or "" for r in doc.get("records", []) if r.get("error")]
    skipped = sum(e.startswith("skipped") for e in errors)
    print(f"results: {SHOWN} (schema {doc.get('schema')}): {len(records)} timed records of "
          f"{len(doc.get('records', []))}; {skipped} skipped by the run's time budget, {len(errors) - skipped} errors")
    if dry:
        print("WARNING: this file comes from a --dry-run (interpreter, CPU timings): its numbers mean nothing")
    SOURCE = Source.of(RESULTS, doc)
    SOURCE_NOTE = "Committed results: " + SOURCE.label() + (" (dry-run: CPU timings, meaningless)" if dry else "")
    print(SOURCE_NOTE)
    display(table([{"device": dev.get("name"), "SMs": dev.get("sms"), "copy bandwidth (TB/s)": copy.get("tbps"),
                    **{k: ver.get(k) for k in ("torch", "triton", "jax", "liger-kernel", "git") if k in ver}}]))
else:
    doc, records, copy, SOURCE_NOTE = None, [], {}, ""
    print(f"No benchmark results are committed yet ({SHOWN} is missing): the plots below "
          "are skipped. Run benchmarks/bench.py on the GPU machine, commit the JSON and rebuild this notebook "
          "(python notebooks/build.py 02).")

# %% [markdown]
# ## How the records are organized
# One record per (op, mode, dtype, shape, implementation, path). Modes: `fwd` (inference forward),
# `bwd_full` (gradients of every input), `bwd_frozen` (weight and bias frozen), `fwd_bwd`. Paths:
# `kernel` is normkit's bare launches (device time), `e2e` goes through each library's public API and
# autograd (wall time of back-to-back calls), which is what a training step sees.

# %%
OP_TITLES = {"rms_norm": "RMSNorm", "layer_norm": "LayerNorm", "fused_add_rms_norm": "Fused add + RMSNorm"}
MODES = ["fwd", "bwd_full", "bwd_frozen"]
LABELS = {("normkit", "kernel"): "normkit kernel", ("normkit", "e2e"): "normkit (torch)",
          ("normkit_jax", "e2e"): "normkit (jax)", ("liger", "e2e"): "Liger", ("torch_eager", "e2e"): "torch eager",
          ("torch_compile", "e2e"): "torch.compile", ("xla", "e2e"): "XLA jit", ("tokamax", "e2e"): "tokamax"}
STYLE = {("normkit", "kernel"): dict(color="black", ls="--"), ("normkit", "e2e"): dict(color="black", lw=2.2),
         ("normkit_jax", "e2e"): dict(color="tab:purple", lw=1.8)}


SHAPE_LABEL = "shape M x N (rows x hidden size)"


def measured(r):
    return r.get("measured_as") is None  # aliases repeat another shape's measurement


ops = [o for o in OP_TITLES if any(r["op"] == o for r in records)]
dtypes = [d for d in ("bf16", "fp32") if any(r["dtype"] == d for r in records)]
impls = [c for c in LABELS if any((r["impl"], r["path"]) == c for r in records)]
dims = {r["shape"]: (r["M"], r["N"]) for r in records if measured(r)}
shapes = sorted(dims, key=lambda s: (dims[s][0] * dims[s][1], dims[s]))
index = {(r["op"], r["mode"], r["dtype"], r["shape"], r["impl"], r["path"]): r for r in records}
if records:
    print("ops:", ops, " dtypes:", dtypes, " shapes (by size):", shapes)
    print("implementations:", [LABELS[c] for c in impls])


def get(op, mode, dtype, shape, impl, field="tbps"):
    r = index.get((op, mode, dtype, shape, *impl))
    return None if r is None else r.get(field)


def grid_plot(value, ylabel, dtype, title, hline=None, logy=False):
    """One panel per (mode, op); one line per implementation; x = shapes by size."""
    fig, axes = plt.subplots(len(MODES), len(ops), figsize=(4.6 * len(ops), 3.2 * len(MODES)),
                             squeeze=False, sharex=True)
    xs = list(range(len(shapes)))
    for i, mode in enumerate(MODES):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for impl in impls:
                ys = [value(op, mode, dtype, s, impl) for s in shapes]
                if any(y is not None for y in ys):
                    ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", ms=3,
                            label=LABELS[impl], **STYLE.get(impl, {}))
            if hline is not None:
                ax.axhline(hline, color="grey", lw=0.8, ls=":")
            if logy:
                ax.set_yscale("log")
            ax.set_title(f"{OP_TITLES[op]} · {mode}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(ylabel)
            if i == len(MODES) - 1:
                ax.set_xticks(xs, [f"{dims[s][0]}x{dims[s][1]}" for s in shapes], rotation=60, fontsize=7)
                ax.set_xlabel(SHAPE_LABEL, fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"{title} ({dtype})", y=1.03)
    fig.tight_layout()
    footnote(fig, SOURCE_NOTE)
    return fig


# %% [markdown]
# ## Bandwidth against shape
# Achieved TB/s under the byte model, per implementation; higher is better. The dotted line is the copy
# bandwidth of the same run, the ceiling for a memory-bound op.

# %%
for dtype in dtypes:
    fig = grid_plot(lambda *a: get(*a, "tbps"), "achieved bandwidth (TB/s)", dtype,
                    "Achieved bandwidth per implementation (higher is better; dotted: copy)", hline=copy.get("tbps"))
    show(fig)

# %% [markdown]
# ## Share of copy bandwidth
# The same numbers divided by the copy bandwidth (%), and, for the large shapes (M ≥ 8192, N ≥ 4096)
# where the kernels are meant to be memory-bound, the median share per implementation.

# %%
for dtype in dtypes[:1]:
    fig = grid_plot(lambda *a: get(*a, "pct_copy"), "share of copy bandwidth (%)", dtype,
                    "Share of copy bandwidth (higher is better; dotted: 100%)", hline=100)
    show(fig)


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


large = [s for s in shapes if dims[s][0] >= 8192 and dims[s][1] >= 4096]
share_rows = []
for dtype in dtypes:
    for op in ops:
        for mode in MODES:
            row = {"dtype": dtype, "op": op, "mode": mode}
            for impl in impls:
                row[f"{LABELS[impl]} (% of copy)"] = median([get(op, mode, dtype, s, impl, "pct_copy") for s in large])
            share_rows.append(row)
if large:
    display(table(share_rows).round(0))

# %% [markdown]
# ## Frozen speedup
# `bwd_full` time / `bwd_frozen` time per implementation: how much a frozen weight (LoRA) saves in the
# backward. normkit runs the dW-free kernel variant (no fp32 partials, no reduction launch). A ratio
# near 1 means the frozen backward costs about as much as the full one.

# %%
def frozen_speedup(op, _mode, dtype, shape, impl):
    full, frozen = get(op, "bwd_full", dtype, shape, impl, "median_us"), get(op, "bwd_frozen", dtype, shape, impl, "median_us")
    return None if not (full and frozen) else full / frozen


if records:
    fig, axes = plt.subplots(len(dtypes), len(ops), figsize=(4.6 * len(ops), 3.4 * len(dtypes)), squeeze=False)
    xs = list(range(len(shapes)))
    for i, dtype in enumerate(dtypes):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for impl in impls:
                ys = [frozen_speedup(op, None, dtype, s, impl) for s in shapes]
                if any(y is not None for y in ys):
                    ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", ms=3, label=LABELS[impl],
                            **STYLE.get(impl, {}))
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set_title(f"{OP_TITLES[op]} · {dtype}", fontsize=10)
            ax.set_xticks(xs, [f"{dims[s][0]}x{dims[s][1]}" for s in shapes], rotation=60, fontsize=7)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("full / frozen backward time (x)")
            if i == len(dtypes) - 1:
                ax.set_xlabel(SHAPE_LABEL, fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Frozen-weight backward speedup (above 1: the frozen backward is faster)", y=1.04)
    fig.tight_layout()
    footnote(fig, SOURCE_NOTE)
    show(fig)
    display(table([{"op": op, "dtype": dtype,
                    **{f"{LABELS[c]} (x)": median([frozen_speedup(op, None, dtype, s, c) for s in large]) for c in impls}}
                   for dtype in dtypes for op in ops]).round(2))

# %% [markdown]
# ## Memory saved
# Peak memory of one backward call (`peak_mem_bytes`: Torch's `max_memory_allocated` delta, outputs
# included; XLA's memory analysis for JAX), full minus frozen. For normkit the difference is the dW
# (and dB) outputs plus the fp32 partial buffers that the frozen variant never allocates.

# %%
def memory_saved(op, dtype, shape, impl):
    full = get(op, "bwd_full", dtype, shape, impl, "peak_mem_bytes")
    frozen = get(op, "bwd_frozen", dtype, shape, impl, "peak_mem_bytes")
    return None if full is None or frozen is None else full - frozen


mem_impls = [c for c in impls if any(memory_saved(op, d, s, c) is not None for op in ops for d in dtypes for s in shapes)]
if mem_impls:
    dtype = dtypes[0]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.6 * len(ops), 3.4), squeeze=False)
    width = 0.8 / len(mem_impls)
    for j, op in enumerate(ops):
        ax = axes[0][j]
        for k, impl in enumerate(mem_impls):
            ys = [memory_saved(op, dtype, s, impl) for s in shapes]
            ax.bar([x + k * width for x in range(len(shapes))], [0 if y is None else y / 2**20 for y in ys],
                   width, label=LABELS[impl], color={("normkit", "kernel"): "grey"}.get(impl, STYLE.get(impl, {}).get("color")))
        ax.set_title(f"{OP_TITLES[op]} · {dtype}", fontsize=10)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))],
                      [f"{dims[s][0]}x{dims[s][1]}" for s in shapes], rotation=60, fontsize=7)
        ax.set_xlabel(SHAPE_LABEL, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        if j == 0:
            ax.set_ylabel("peak memory saved, full − frozen (MiB)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), bbox_to_anchor=(0.5, 1.08))
    fig.suptitle(f"Peak memory saved by freezing, one backward ({dtype})", y=1.14)
    fig.tight_layout()
    footnote(fig, SOURCE_NOTE)
    show(fig)
    partial_rows = []
    for r in records:
        extra = r.get("extra") or {}
        if r["impl"] == "normkit" and r["path"] == "kernel" and r["mode"] == "bwd_full" and "partial_bytes" in extra \
                and r["dtype"] == dtype and measured(r):
            saved = memory_saved(r["op"], dtype, r["shape"], ("normkit", "e2e"))
            partial_rows.append({"op": r["op"], "shape": f"{r['M']}x{r['N']}",
                                 "fp32 partials of the full backward (MiB)": extra["partial_bytes"] / 2**20,
                                 "peak saved, normkit torch (MiB)": None if saved is None else saved / 2**20})
    if partial_rows:
        display(table(partial_rows).round(2))
elif records:
    print("no peak-memory figures in the results")

# %% [markdown]
# ## Re-measured here (GPU only)
# With a CUDA GPU present, this cell times normkit (Torch frontend) and torch eager RMSNorm in bf16 on
# a few shapes, forward and both backwards, timed as the committed end-to-end records were
# (`benchmarks.timing.Timer.loop`: back-to-back calls, input sets rotated past the L2), and puts the
# committed numbers beside them. Bytes come from the committed records of the same (op, mode,
# dtype, shape) when present, so both use one byte model. On CPU it does nothing: the interpreter's
# timings would mean nothing.

# %%
import torch  # noqa: E402

if torch.cuda.is_available():
    import torch_frontend as tf
    from benchmarks import bytemodel
    from benchmarks.timing import Timer, num_sets, torch_sync

    timer = Timer(warmup_ms=25, rep_ms=100)

    def bench_rms(M, N, impl):
        """µs per call of the forward and both backwards, timed as bench.py's e2e records are: back-to-back
        calls (``Timer.loop``), input sets rotated so that their sum exceeds the L2."""
        k = num_sets(3 * M * N * 2)  # x, dy and the output, bf16
        xs = [torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        dys = [torch.randn_like(x) for x in xs]
        w = (torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5)
        fn = (lambda x, w: tf.rms_norm(x, w, 1e-6)) if impl == "normkit" else \
            (lambda x, w: torch.nn.functional.rms_norm(x, (N,), w, 1e-6))
        out = {}
        with torch.no_grad():
            out["fwd"] = timer.loop(lambda i: fn(xs[i % k], w), torch_sync)
        for mode, train_w in (("bwd_full", True), ("bwd_frozen", False)):
            wg = w.clone().requires_grad_(train_w)
            xgs = [x.clone().requires_grad_(True) for x in xs]
            ys = [fn(xg, wg) for xg in xgs]
            wrt = [(xg, wg) if train_w else (xg,) for xg in xgs]
            out[mode] = timer.loop(lambda i: torch.autograd.grad(ys[i % k], wrt[i % k], dys[i % k], retain_graph=True),
                                   torch_sync)
        return out

    here_copy = timer.copy_bandwidth()["tbps"]
    print(f"copy bandwidth here: {here_copy:.2f} TB/s ({torch.cuda.get_device_name(0)})")
    check_shapes = {"smoke": [(4096, 4096)], "full": [(4096, 4096), (8192, 8192), (32768, 4096)]}[SIZE]
    rows = []
    for M, N in check_shapes:
        name = next((s for s in shapes if dims[s] == (M, N)), None)
        for impl in ("normkit", "torch_eager"):
            for mode, us in bench_rms(M, N, impl).items():
                nbytes = (get("rms_norm", mode, "bf16", name, (impl, "e2e"), "bytes") if name else None) \
                    or bytemodel.bytes_moved("rms_norm", mode, M, N, 2)  # bf16; this shape is not in the file
                committed = get("rms_norm", mode, "bf16", name, (impl, "e2e"), "median_us") if name else None
                rows.append({"shape": f"{M}x{N}", "impl": impl, "mode": mode, "here (µs)": us,
                             "here (% of copy)": 100 * nbytes / (us * 1e-6) / 1e12 / here_copy,
                             "committed (µs)": committed})
    fig, ax = plt.subplots(figsize=(10, 3.8))
    grouped_bars(ax, [f"{r['shape']}\n{r['impl']}\n{r['mode']}" for r in rows],
                 {"here": [r["here (µs)"] for r in rows], "committed": [r["committed (µs)"] for r in rows]},
                 colors={"here": "tab:green", "committed": "tab:gray"})
    ax.set_ylabel("time per call (µs)")
    ax.set_xlabel("shape, implementation and mode (RMSNorm, bf16)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(ncol=2, loc="upper left")
    ax.set_title("RMSNorm re-measured here against the committed results (lower is faster)")
    fig.tight_layout()
    footnote(fig, this_run(SIZE) + "\n" + SOURCE_NOTE)
    show(fig)
    display(table(rows).round(1))
else:
    print("No CUDA GPU here: nothing re-measured." + (f" The figures above are read from {SHOWN}." if records else ""))
