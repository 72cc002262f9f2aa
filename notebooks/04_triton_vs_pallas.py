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
import os
import warnings

import numpy as np

from _nbutil import display, environment, notebook_size, table  # first: puts the repository on sys.path

import jax
import jax.numpy as jnp

import jax_frontend as nk
import normkit
from benchmarks import bytemodel
from benchmarks.timing import DryTimer, num_sets
from normkit.ops import OPS
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
# 1024 x 8192 (the float64 reference and the comparisons run on the host), timing on 8192 x 8192 (one
# bf16 array is 128 MiB: large enough that a call's time is the memory traffic, not the dispatch). The
# same N lets the Triton columns reuse their compiled kernels (M is not specialized on).
M, N = {"smoke": (64, 256), "full": (1024, 8192)}[SIZE]
TM, TN = {"smoke": (64, 256), "full": (8192, 8192)}[SIZE]
DTYPES = ["bfloat16", "float32"]
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
JAX_DT = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
VARIANTS = ["full", "frozen"]  # full: every input trained; frozen: weight and bias frozen
print(f"size: {SIZE}; accuracy on {M} x {N}, timing on {TM} x {TN}; JAX backend: {jax.default_backend()}")
try:
    info = environment()
except ImportError:  # environment() reports torch's and Triton's versions too
    info = {"jax": jax.__version__, "jax devices": ", ".join(sorted({d.platform for d in jax.devices()}))}
table([info])

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
table([{"column": c, "runs": "yes" if c in COLUMNS else "skipped", "how": HOW[c], "why skipped": SKIPPED.get(c)}
       for c in HOW])

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
                                    "fp32 partial bytes": launch.partial_bytes, "interpreted": launch.interpreted})
print(f"{len(AGREE)} runs checked: {len(COLUMNS)} columns x {len(OPS)} ops x {len(DTYPES)} dtypes x "
      f"{len(VARIANTS)} variants; all within tolerance, all gradients bitwise equal across two runs")

# %% [markdown]
# Share of the tolerance used, `max |actual − ref| / (atol·scale + rtol·|ref|)` (below 1 passes; scale
# is √M for dW and dB). Columns name the output (`y`, `residual_out`) or the gradient (`dx`, ...).

# %%
TOL_COLUMNS = ["y", "residual_out", "dx", "dresidual", "dweight", "dbias", "2 runs bitwise equal"]
table(AGREE, ["column", "op", "dtype", "variant"] + TOL_COLUMNS, floatfmt=".2f")

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
table(CROSS, ["column", "vs", "op", "dtype", "variant"] + TOL_COLUMNS[:-1] + ["bitwise equal"], floatfmt=".3g")

# %% [markdown]
# ## What freezing changes in the backward
#
# The launch records of the bf16 runs (the variants do not depend on the dtype): which backward
# launches ran, with which flags, and the fp32 partial-dW/dB bytes they wrote. The frozen backward of
# every implementation skips dW/dB; Triton and Pallas also skip the partial buffer and the reduction.

# %%
table([r for r in LAUNCH_ROWS if r["dtype"] == "bfloat16"],
      ["column", "op", "variant", "implementation", "backward launches", "DW", "DB", "fp32 partial bytes",
       "interpreted"])

# %% [markdown]
# ## Time, bandwidth and frozen savings
#
# Each column is timed the same way, end to end as a network calls it: the forward under `jax.jit`
# (Torch: under `no_grad`), the backward as the vjp function of a separately jitted forward (Torch:
# `autograd.grad` of a saved graph). On a GPU: `benchmarks.timing.GpuTimer.loop` (back-to-back calls,
# one sync per batch, median over batches), input sets rotated past the L2 as `benchmarks/bench.py`
# does, and % of copy = the byte model's bytes (`benchmarks/bytemodel.py`: each input read once, each
# output written once; fp32 partials not counted) per second over a device-to-device copy's bandwidth
# measured here. On CPU: the median of three wall-clock calls (`benchmarks.timing.DryTimer`).

# %%
GPU_TIMING = ON_GPU
COPY = None
if ON_GPU and HAVE_TORCH and torch.cuda.is_available():
    from benchmarks.timing import GpuTimer

    timer = GpuTimer(warmup_ms=5, rep_ms=50)
    COPY = timer.copy_bandwidth()
    print(f"copy bandwidth: {COPY['tbps']:.2f} TB/s ({COPY['what']})")
elif ON_GPU:  # GpuTimer and the copy benchmark use torch: time the same way without them, and no % of copy
    from benchmarks import timing

    class _Timer:
        def loop(self, call, sync):
            return timing._loop(call, sync, 5.0, 50.0, 5)

    timer = _Timer()
    print("no torch with CUDA here: no copy-bandwidth measurement, so no % of copy below")
else:
    timer = DryTimer(reps=3)
    print("CPU: the times below mean NOTHING about GPU performance (Triton and Pallas run in interpreters "
          "here; wall clock, median of 3 calls). % of copy is shown on a GPU only.")
MODES = ["fwd", "bwd_full", "bwd_frozen"]


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
    for dtype in DTYPES:
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
    rows.append({"op": name, "dtype": SHORT[dtype], "mode": mode, "column": col, "µs": us,
                 "% of copy": pct_copy(name, dtype, mode, us),
                 f"÷ {BASE}": us / TIMES[BASE, name, dtype, mode]})
rows.sort(key=lambda r: (list(OPS).index(r["op"]), r["dtype"], MODES.index(r["mode"]), COLUMNS.index(r["column"])))
table(rows, floatfmt=".3g")

# %% [markdown]
# ### Frozen vs full backward
#
# Time of the frozen backward over the full one, per column (`saved` = 1 − frozen / full), and the
# byte model's difference (the dW/dB writes only: the fp32 partials the full backward also writes and
# reads back are not in the model, see the launch records above for their size).

# %%
saving_rows = []
for op in OPS.values():
    for dtype in DTYPES:
        item = {"bfloat16": 2, "float32": 4}[dtype]
        row = {"op": op.name, "dtype": SHORT[dtype],
               "model bytes saved": bytemodel.bytes_moved(op.name, "bwd_full", TM, TN, item)
               - bytemodel.bytes_moved(op.name, "bwd_frozen", TM, TN, item)}
        for col in COLUMNS:
            full, frozen = TIMES[col, op.name, dtype, "bwd_full"], TIMES[col, op.name, dtype, "bwd_frozen"]
            row[f"{col}: full → frozen µs"] = f"{full:.4g} → {frozen:.4g}"
            row[f"{col}: saved"] = f"{1 - frozen / full:.0%}"
        saving_rows.append(row)
table(saving_rows)

# %% [markdown]
# Reading the GPU numbers: Triton through JAX and through Torch are the same kernels on the same grids,
# so a difference between those two columns is the frontends' dispatch. Pallas's lowering emits code of
# the same shape as the Triton kernel (one row block per program, masked loads), but Pallas does not
# pipeline the full backward's persistent tile loop for it (the kernel body prefetches the next tile by
# hand). The README quotes the H200 figures (bf16): Pallas forward at 95-97% of copy for RMSNorm
# (74-93% LayerNorm), frozen backward 93-96%, full backward 1.44-2.2x faster than XLA.
# `benchmarks/bench.py --peers jax-impls,xla` measures the same comparison on every benchmark shape; its
# report has a "JAX implementations: Triton vs Pallas vs XLA" section (`benchmarks/results/h200.md`).
