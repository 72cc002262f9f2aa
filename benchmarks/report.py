"""Turn a bench.py results JSON into a markdown report, PNG plots and the README's headline table.

    python3 benchmarks/report.py benchmarks/results/h200.json [--readme README.md] [--no-plots]

Writes, next to the JSON: ``<stem>.md`` (headline, targets, per-op tables, the JAX frontend's
Triton vs Pallas vs XLA implementations, memory, errors; tables through ``pandas.DataFrame.to_markdown``,
which needs tabulate) and
``<stem>_*.png`` (bandwidth per shape and implementation, % of copy, frozen speedup, memory saved;
only where matplotlib imports). Rewrites the part of the README between ``<!-- bench:start -->``
and ``<!-- bench:end -->`` when both markers are there; never creates a README.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.bytemodel import DTYPES, MODES, OPS  # noqa: E402
from normkit.ops import OPS as OP_SPECS  # noqa: E402

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
OP_TITLES = {name: op.title for name, op in OP_SPECS.items()}
# (impl, path) columns in display order; normkit first.
COLUMNS = (("normkit", "kernel"), ("normkit", "e2e"), ("normkit_jax", "e2e"), ("normkit_jax_pallas", "e2e"),
           ("normkit_jax_xla", "e2e"), ("liger", "e2e"), ("torch_eager", "e2e"), ("torch_compile", "e2e"),
           ("xla", "e2e"), ("tokamax", "e2e"))
TORCH_PEERS = ("liger", "torch_eager", "torch_compile")
PEERS = TORCH_PEERS + ("xla", "tokamax")
LABELS = {("normkit", "kernel"): "normkit kernel", ("normkit", "e2e"): "normkit (torch)",
          ("normkit_jax", "e2e"): "normkit (jax)", ("normkit_jax_pallas", "e2e"): "normkit (jax, pallas)",
          ("normkit_jax_xla", "e2e"): "normkit (jax, xla)", ("liger", "e2e"): "Liger 0.8.5", ("torch_eager", "e2e"): "torch eager",
          ("torch_compile", "e2e"): "torch.compile", ("xla", "e2e"): "XLA jit", ("tokamax", "e2e"): "tokamax"}
COLORS = {("normkit", "kernel"): "#1f4e9c", ("normkit", "e2e"): "#3a86ff", ("normkit_jax", "e2e"): "#8338ec",
          ("normkit_jax_pallas", "e2e"): "#c77dff", ("normkit_jax_xla", "e2e"): "#06d6a0",
          ("liger", "e2e"): "#fb5607", ("torch_eager", "e2e"): "#6c757d", ("torch_compile", "e2e"): "#d62828",
          ("xla", "e2e"): "#2a9d8f", ("tokamax", "e2e"): "#e9c46a"}
# The JAX frontend's implementations (bench.py: implementation=None / "pallas" / "xla"), and the jnp
# reference under JAX's own autodiff for comparison.
JAX_IMPLS = (("normkit_jax", "Triton"), ("normkit_jax_pallas", "Pallas"), ("normkit_jax_xla", "XLA"),
             ("xla", "jnp autodiff"))
TARGETS = {"fwd": 90.0, "bwd_frozen": 90.0, "bwd_full": 85.0}  # % of copy of normkit's kernels, M >= 8192, N >= 4096


def markdown_table(rows: list[dict]) -> str:
    """A Markdown table of ``rows`` (one dict per row, its keys the columns), cells as given: the one
    table renderer of the reports (``pandas.DataFrame.to_markdown``, through tabulate)."""
    import pandas as pd

    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)


def headline_shapes(d) -> tuple[list[str], bool]:
    """The measured M >= 8192, N >= 4096 shapes; every measured shape when there is none (dry run)."""
    hs = [s for s in d.shapes if d.dims[s][0] >= 8192 and d.dims[s][1] >= 4096]
    return (hs, True) if hs else (list(d.shapes), False)


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


class Data:
    def __init__(self, doc: dict):
        self.doc = doc
        self.records = doc.get("records", [])
        self.by_key = {(r["op"], r["mode"], r["dtype"], r["shape"], r["impl"], r["path"]): r for r in self.records}
        # Measured shapes only (aliases repeat a measurement), ordered by size.
        shapes = {}
        for r in self.records:
            if r.get("measured_as") is None:
                shapes[r["shape"]] = (r["M"], r["N"])
        self.shapes = sorted(shapes, key=lambda s: (shapes[s][0] * shapes[s][1], shapes[s]))
        self.dims = shapes
        self.dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in self.records)]
        self.ops = [o for o in OPS if any(r["op"] == o for r in self.records)]
        self.modes = [m for m in MODES if any(r["mode"] == m for r in self.records)]
        self.columns = [c for c in COLUMNS if any((r["impl"], r["path"]) == c for r in self.records)]

    def get(self, op, mode, dtype, shape, impl, path="e2e"):
        r = self.by_key.get((op, mode, dtype, shape, impl, path))
        return r if r is not None and r.get("median_us") else None

    def us(self, *key):
        r = self.get(*key)
        return r["median_us"] if r else None


def _fmt_us(us):
    return "—" if us is None else (f"{us:.1f}" if us < 1000 else f"{us:.0f}")


def _fmt_x(x):
    return "—" if x is None else f"{x:.2f}×"


def _pct_range(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    return f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}%"


def _time_ratios(d: Data, op, mode, dtype, shapes, num, den) -> list[float]:
    """num's time / den's time on each of ``shapes`` where both have one."""
    pairs = ((d.us(op, mode, dtype, s, num), d.us(op, mode, dtype, s, den)) for s in shapes)
    return [a / b for a, b in pairs if a and b]


def _time_cell(d: Data, op, mode, dtype, s, impl, path="e2e", best=None) -> str:
    """One table cell: median µs (% of copy), bold when it is ``best``; else why there is no time."""
    r = d.get(op, mode, dtype, s, impl, path)
    if r is None:
        raw = d.by_key.get((op, mode, dtype, s, impl, path))
        return ("skipped" if raw and (raw.get("error") or "").startswith("skipped")
                else ("error" if raw and raw.get("error") else "—"))
    txt = f"{_fmt_us(r['median_us'])} ({r['pct_copy']:.0f}%)" if r.get("pct_copy") is not None \
        else _fmt_us(r["median_us"])
    return f"**{txt}**" if r["median_us"] == best else txt


def _speedup_cell(d: Data, op, mode, dtype, shapes, impl, peer):
    xs = _time_ratios(d, op, mode, dtype, shapes, peer, impl)
    if not xs:
        return "—"
    g = _geomean(xs)
    return f"{g:.2f}× (min {min(xs):.2f}×)" if len(xs) > 1 else f"{g:.2f}×"


def _wins(d: Data, op, mode, dtype):
    """Shapes where normkit (torch e2e) beats every peer with a time, of the shapes with a normkit time."""
    won = total = 0
    for s in d.shapes:
        nk = d.us(op, mode, dtype, s, "normkit")
        peers = [d.us(op, mode, dtype, s, p) for p in PEERS]
        peers = [p for p in peers if p]
        if nk is None or not peers:
            continue
        total += 1
        won += nk < min(peers)
    return f"{won}/{total}" if total else "—"


def headline_table(d: Data) -> str:
    hs, _ = headline_shapes(d)
    rows = []
    for op in d.ops:
        for mode in d.modes:
            for dtype in d.dtypes:
                speedup = [_speedup_cell(d, op, mode, dtype, hs, "normkit", p) for p in TORCH_PEERS]
                rows.append({
                    "op": OP_TITLES[op], "mode": mode, "dtype": dtype,
                    "normkit kernel, % of copy": _pct_range(
                        [(d.get(op, mode, dtype, s, "normkit", "kernel") or {}).get("pct_copy") for s in hs]),
                    "normkit e2e, % of copy": _pct_range(
                        [(d.get(op, mode, dtype, s, "normkit") or {}).get("pct_copy") for s in hs]),
                    "e2e speedup vs Liger": speedup[0], "vs torch eager": speedup[1], "vs torch.compile": speedup[2],
                    "normkit (jax) vs XLA": _speedup_cell(d, op, mode, dtype, hs, "normkit_jax", "xla"),
                    "fastest e2e on": _wins(d, op, mode, dtype)})
    return markdown_table(rows)


def headline_preamble(d: Data) -> str:
    dev = d.doc.get("device", {}).get("name", "?")
    copy = d.doc.get("copy", {}).get("tbps")
    v = d.doc.get("versions", {})
    stack = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "jax", "liger-kernel") if v.get(k))
    hs, big = headline_shapes(d)
    which = "the M ≥ 8192, N ≥ 4096 shapes" if big else "all measured shapes (none has M ≥ 8192 and N ≥ 4096)"
    return (f"{dev}; copy bandwidth {copy:.2f} TB/s (read + write), measured in the same run; {stack}.\n"
            f"Percentages and speedups over {which} ({', '.join(hs) or 'none'}): "
            "range of % of copy bandwidth, and geometric-mean speedup (minimum in brackets) of normkit's "
            "end-to-end time over each peer's (> 1× means normkit is faster). \"Fastest e2e on\" counts every "
            "measured shape where normkit through torch beats every peer that has a time."
            if copy else f"{dev}.")


def targets_section(d: Data) -> str:
    out = ["## Targets", ""]
    hs = [s for s in d.shapes if d.dims[s][0] >= 8192 and d.dims[s][1] >= 4096]  # no fallback: targets are for these
    for mode, target in TARGETS.items():
        miss, n = [], 0
        for op in d.ops:
            for dtype in d.dtypes:
                for s in hs:
                    r = d.get(op, mode, dtype, s, "normkit", "kernel")
                    if r is None:
                        continue
                    n += 1
                    if r["pct_copy"] < target:
                        miss.append(f"{OP_TITLES[op]} {dtype} {s} {r['pct_copy']:.0f}%")
        out.append(f"- {mode} ≥ {target:.0f}% of copy (normkit kernel, M ≥ 8192, N ≥ 4096): "
                   + (f"met on {n - len(miss)}/{n}" if n else "no data")
                   + (f"; missed: {', '.join(miss)}" if miss else ""))
    lost, n = [], 0
    for op in d.ops:
        for mode in d.modes:
            for dtype in d.dtypes:
                for s in d.shapes:
                    nk = d.us(op, mode, dtype, s, "normkit")
                    if nk is None:
                        continue
                    for p in PEERS:
                        pu = d.us(op, mode, dtype, s, p)
                        if pu is None:
                            continue
                        n += 1
                        if pu <= nk:
                            lost.append(f"{OP_TITLES[op]} {mode} {dtype} {s} vs {p} ({nk:.1f} vs {pu:.1f} µs)")
    by_peer = {}
    for item in lost:
        peer = item.split(" vs ")[1].split(" ")[0]
        by_peer[peer] = by_peer.get(peer, 0) + 1
    out.append(f"- faster than every peer end to end: {n - len(lost)}/{n} comparisons won"
               + (f"; lost {len(lost)} (" + ", ".join(f"{k}: {v}" for k, v in sorted(by_peer.items())) + "), e.g. "
                  + "; ".join(lost[:12]) + (" …" if len(lost) > 12 else "") if lost else ""))
    far, n = [], 0
    for op in d.ops:
        for mode in d.modes:
            for dtype in d.dtypes:
                for s in d.shapes:
                    kj = d.us(op, mode, dtype, s, "normkit_jax")
                    kt = d.us(op, mode, dtype, s, "normkit", "kernel")
                    xl = d.us(op, mode, dtype, s, "xla")
                    if kj is None or kt is None:
                        continue
                    n += 1
                    if kj > 1.05 * kt or (xl is not None and kj >= xl):
                        far.append(f"{OP_TITLES[op]} {mode} {dtype} {s} ({kj:.1f} µs jax, {kt:.1f} µs kernel"
                                   + (f", {xl:.1f} µs XLA)" if xl is not None else ")"))
    out.append(f"- JAX frontend within 5% of the torch kernel time and faster than XLA: "
               + (f"{n - len(far)}/{n}" if n else "no data")
               + (f"; missed ({len(far)}), e.g. " + "; ".join(far[:12]) + (" …" if len(far) > 12 else "") if far else ""))
    slow, mem_bad, n, n_mem = [], [], 0, 0
    for op in d.ops:
        for dtype in d.dtypes:
            for s in d.shapes:
                for impl, path in (("normkit", "kernel"), ("normkit", "e2e")):
                    full, frozen = d.get(op, "bwd_full", dtype, s, impl, path), d.get(op, "bwd_frozen", dtype, s, impl, path)
                    if not full or not frozen:
                        continue
                    n += 1
                    if frozen["median_us"] > full["median_us"]:
                        slow.append(f"{OP_TITLES[op]} {dtype} {s} {path}")
                    if path == "kernel" and full.get("peak_mem_bytes") is not None and frozen.get("peak_mem_bytes") is not None:
                        n_mem += 1
                        part = (full.get("extra") or {}).get("partial_bytes") or 0
                        if full["peak_mem_bytes"] - frozen["peak_mem_bytes"] < part:
                            mem_bad.append(f"{OP_TITLES[op]} {dtype} {s}")
    out.append(f"- frozen backward never slower than full: "
               + (f"{n - len(slow)}/{n}" if n else "no data") + (f"; slower: {', '.join(slow)}" if slow else ""))
    out.append("- frozen peak memory lower by at least the partial buffer (normkit kernel path): "
               + ("no data" if not n_mem else (f"met on {n_mem}/{n_mem}" if not mem_bad
                                               else f"missed on {len(mem_bad)}/{n_mem}: {', '.join(mem_bad)}")))
    return "\n".join(out)


def op_tables(d: Data) -> str:
    out = []
    for op in d.ops:
        out.append(f"## {OP_TITLES[op]}")
        for dtype in d.dtypes:
            cols = d.columns
            out.append("")
            out.append(f"### {OP_TITLES[op]}, {dtype}: median µs (% of copy); **bold**: fastest end to end")
            out.append("")
            rows = []
            for s in d.shapes:
                for mode in d.modes:
                    e2e = {c: d.us(op, mode, dtype, s, *c) for c in cols if c[1] == "e2e"}
                    best = min((u for u in e2e.values() if u), default=None)
                    rows.append({"shape": _shape_label(d, s), "mode": mode,
                                 **{LABELS[c]: _time_cell(d, op, mode, dtype, s, *c, best=best if c[1] == "e2e" else None)
                                    for c in cols}})
            out.append(markdown_table(rows))
        out.append("")
    return "\n".join(out)


def _resolved(d: Data, impl: str) -> str | None:
    """The implementation a normkit_jax* impl ran, from the latest run's peer status
    ("ok (implementation triton)"), or None when no run says."""
    for run in reversed(d.doc.get("runs", [])):
        st = str((run.get("peers") or {}).get(impl, ""))
        if st.startswith("ok") and "implementation " in st:
            return st.split("implementation ", 1)[1].rstrip(")").strip()
    return None


def _ratio_cell(d: Data, op, mode, dtype, shapes, impl, base="normkit_jax"):
    """Geometric mean (and range) over shapes of impl's time / base's time (> 1: impl is slower)."""
    xs = _time_ratios(d, op, mode, dtype, shapes, impl, base)
    if not xs:
        return "—"
    g = _geomean(xs)
    return f"{g:.2f}× ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else f"{g:.2f}×"


def _frozen_saving(d: Data, op, dtype, s, impl):
    """(full µs, frozen µs, saving = 1 - frozen / full) of one implementation, or None."""
    full, frozen = d.us(op, "bwd_full", dtype, s, impl), d.us(op, "bwd_frozen", dtype, s, impl)
    if not full or not frozen:
        return None
    return full, frozen, 1.0 - frozen / full


def jax_impls_section(d: Data) -> str:
    """The JAX frontend's implementations side by side: time, % of copy, frozen savings."""
    present = [(impl, name) for impl, name in JAX_IMPLS if any(r["impl"] == impl for r in d.records)]
    out = ["## JAX implementations: Triton vs Pallas vs XLA", ""]
    if not any(impl in ("normkit_jax_pallas", "normkit_jax_xla") for impl, _ in present):
        out.append("No records of `normkit_jax_pallas` / `normkit_jax_xla` in this file: run "
                   "`python3 benchmarks/bench.py --peers jax-impls,xla --merge <json> --skip-done` to add them (what is "
                   "already in the file is not timed again).")
        return "\n".join(out)
    auto = _resolved(d, "normkit_jax")
    note = "" if auto in (None, "triton") else (f" **Note: in this run auto resolved to `{auto}`, not Triton, so the "
                                                 "\"Triton\" column is not Triton.**")
    out += ["The same ops through `jax_frontend` with `implementation=`: **Triton** (`normkit_jax`, auto: "
            "`normkit/kernels/norm.py` through jax-triton), **Pallas** (`normkit_jax_pallas`: "
            "`normkit/kernels/norm_pallas.py` through `pallas_call`, Pallas's Triton lowering on the GPU) and "
            "**XLA** (`normkit_jax_xla`: plain `jax.numpy`), all three under normkit's one `custom_vjp` with its "
            "frozen semantics (a frozen weight's dW is never computed), timed identically end to end (jitted "
            "forward; backward = the vjp function of a separately jitted forward). **jnp autodiff** is the `xla` "
            "peer: a jnp expression differentiated by JAX's own autodiff, for reference." + note, ""]
    hs, big = headline_shapes(d)
    which = "M ≥ 8192, N ≥ 4096 shapes" if big else "measured shapes"
    names = [name for _, name in present]
    others = [(impl, name) for impl, name in present if impl != "normkit_jax"]
    summary, saving = [], []
    for op in d.ops:
        for mode in d.modes:
            for dtype in d.dtypes:
                pcts = {f"{n}, % of copy": _pct_range([(d.get(op, mode, dtype, s, impl) or {}).get("pct_copy")
                                                       for s in hs]) for impl, n in present}
                if any(c != "—" for c in pcts.values()):
                    summary.append({"op": OP_TITLES[op], "mode": mode, "dtype": dtype, **pcts,
                                    **{f"{n} ÷ Triton": _ratio_cell(d, op, mode, dtype, hs, impl) for impl, n in others}})
    for op in d.ops:
        for dtype in d.dtypes:
            for s in d.shapes:
                cells = {n: _saving_cell(_frozen_saving(d, op, dtype, s, impl)) for impl, n in present}
                if any(c != "—" for c in cells.values()):
                    saving.append({"op": OP_TITLES[op], "dtype": dtype, "shape": s, **cells})
    out += [f"### Summary over the {which} ({', '.join(hs)}): % of copy (range); time ÷ Triton's, geometric "
            "mean (range; > 1× is slower than Triton)", "", markdown_table(summary), "",
            "### Frozen vs full backward: bwd_full → bwd_frozen µs, and the time saved by freezing the weight and bias "
            "(x and the residual still trained)", "", markdown_table(saving)]
    for op in d.ops:
        for dtype in d.dtypes:
            rows = []
            for s in d.shapes:
                for mode in d.modes:
                    best = min((u for u in (d.us(op, mode, dtype, s, impl) for impl, _ in present) if u), default=None)
                    cells = {n: _time_cell(d, op, mode, dtype, s, impl, best=best) for impl, n in present}
                    for impl, n in others:
                        a, b = d.us(op, mode, dtype, s, impl), d.us(op, mode, dtype, s, "normkit_jax")
                        cells[f"{n} ÷ Triton"] = _fmt_x(a / b if a and b else None)
                    if any(c not in ("—", "skipped", "error") for c in cells.values()):
                        rows.append({"shape": _shape_label(d, s), "mode": mode, **cells})
            if rows:
                out += ["", f"### {OP_TITLES[op]}, {dtype}, JAX implementations: median µs (% of copy); "
                        "**bold**: fastest; then time ÷ Triton's", "", markdown_table(rows)]
    return "\n".join(out)


def _saving_cell(fz) -> str:
    if fz is None:
        return "—"
    full, frozen, saved = fz
    how = f"{100 * saved:.0f}% saved" if saved >= 0 else f"{-100 * saved:.0f}% slower"
    return f"{_fmt_us(full)} → {_fmt_us(frozen)} ({how})"


def _shape_label(d: Data, s: str) -> str:
    M, N = d.dims[s]
    return f"{s} ({M}×{N})"


def memory_table(d: Data) -> str:
    rows = []
    for op in d.ops:
        for dtype in d.dtypes:
            for s in d.shapes:
                cells = {}
                for c in d.columns:
                    f, z = d.get(op, "bwd_full", dtype, s, *c), d.get(op, "bwd_frozen", dtype, s, *c)
                    fm, zm = (f or {}).get("peak_mem_bytes"), (z or {}).get("peak_mem_bytes")
                    cells[LABELS[c]] = "—" if fm is None or zm is None else f"{fm / 2**20:.1f} → {zm / 2**20:.1f}"
                if any(c != "—" for c in cells.values()):
                    rows.append({"op": OP_TITLES[op], "dtype": dtype, "shape": s, **cells})
    return "\n".join(["## Peak memory of the backward: full → frozen (MiB)", "",
                      "Torch: `torch.cuda.max_memory_allocated` above the allocation before one backward call, its "
                      "outputs included (Liger's RMSNorm writes dx into dy's buffer). JAX: XLA's `memory_analysis()` "
                      "of the compiled backward (temporaries + outputs). The saving of a frozen backward is the dW/dB "
                      "outputs plus, for normkit and Liger, their fp32 partial buffers.", "",
                      markdown_table(rows) if rows else "No memory figures in this file."])


def errors_section(d: Data) -> str:
    errs, skipped = {}, 0
    for r in d.records:
        e = r.get("error")
        if not e or r.get("measured_as"):
            continue
        if e.startswith("skipped"):
            skipped += 1
            continue
        errs.setdefault((r["impl"], r["path"]), []).append(r)
    out = ["## Errors and gaps", ""]
    runs = d.doc.get("runs", [])
    for run in runs:
        peers = run.get("peers", {})
        unavailable = {k: v for k, v in peers.items() if not str(v).startswith("ok")}
        for k, v in unavailable.items():
            out.append(f"- run {run.get('run_id')}: {k}: {v}")
    if skipped:
        out.append(f"- {skipped} measurements skipped because the time budget ran out (rerun with "
                   "`--merge <json> --skip-done`).")
    for (impl, path), rs in sorted(errs.items()):
        first = rs[0]
        out.append(f"- {impl} {path}: {len(rs)} errors, e.g. {first['op']} {first['mode']} {first['dtype']} "
                   f"{first['shape']}: `{first['error'][:300]}`")
    if len(out) == 2:
        out.append("- none")
    return "\n".join(out)


def method_section(d: Data) -> str:
    bm = d.doc.get("byte_model", {})
    lines = ["## Method", "",
             "- Byte model (benchmarks/bytemodel.py): each input read once, each output written once per pass; "
             "fp32 partial-dW/dB traffic is **not** counted (normkit's kernel records carry it as "
             "`extra.partial_bytes`), nor what an implementation saves or recomputes beyond the per-row statistics.",
             "- `kernel`: normkit's bare launches, `triton.testing.do_bench` median (L2 flushed before each call). "
             "`e2e`: the public API through autograd / `jax.vjp`, median over batches of back-to-back calls with one "
             "sync per batch, so host overhead shows where it dominates.",
             "- Inputs rotate through several sets when one set is under 200 MB (L2 is 60 MB).",
             "- JAX backward: the vjp function returned by a separately jitted forward; torch.compile: one compile per "
             "shape (`dynamic=False`, `fullgraph=True`), `torch._dynamo.reset()` between shapes, recompiles during "
             "timing are errors.", "", "Bytes counted per op and mode:", ""]
    for op, modes in bm.items():
        for mode, terms in modes.items():
            lines.append(f"- {OP_TITLES.get(op, op)} {mode}: " + ", ".join(terms))
    return "\n".join(lines)


# The cells of the Torch end-to-end comparison: 3 ops x 3 modes x these (dtype, M x N): 81 in all.
CELL_MODES = ("fwd", "bwd_full", "bwd_frozen")
CELL_SHAPES = [("bf16", s) for s in ("4096x1024", "4096x4096", "8192x4096", "8192x8192", "16384x8192",
                                     "32768x4096", "65536x2048")] + [("fp32", "8192x8192"), ("fp32", "32768x4096")]


def cells_section(d: Data) -> str:
    """Every cell: normkit through torch (autograd, end to end) against the fastest Torch peer in it."""
    rows, won, missing = [], 0, 0
    for op in OPS:
        for mode in CELL_MODES:
            for dtype, shape in CELL_SHAPES:
                nk = d.us(op, mode, dtype, shape, "normkit")
                peers = {p: d.us(op, mode, dtype, shape, p) for p in TORCH_PEERS}
                peers = {p: u for p, u in peers.items() if u}
                cell = {"op": OP_TITLES[op], "mode": mode, "cell": f"{dtype} {shape}"}
                if nk is None or not peers:
                    missing += 1
                    rows.append({**cell, "normkit": _fmt_us(nk) if nk else "not measured",
                                 "best peer": "" if peers else "—", "best ÷ normkit": "—", "fastest": "—"})
                    continue
                best = min(peers, key=peers.get)
                ratio = peers[best] / nk  # > 1: normkit is faster
                won += ratio >= 1.0
                rows.append({**cell, "normkit": _fmt_us(nk), "best peer": f"{best} {_fmt_us(peers[best])}",
                             "best ÷ normkit": f"{ratio:.2f}×" + ("" if ratio >= 1.0 else " (slower)"),
                             "fastest": "normkit" if ratio >= 1.0 else best})
    total = len(OPS) * len(CELL_MODES) * len(CELL_SHAPES)
    head = [f"## Torch end to end, cell by cell: normkit is at least as fast as the best peer in {won} of "
            f"{total - missing} measured cells ({missing} of {total} not measured)", "",
            "Times are medians in µs through `torch.autograd` (forward, full backward, frozen backward), peers "
            f"{', '.join(TORCH_PEERS)}; the ratio is the best peer's time over normkit's (≥ 1× means normkit wins).",
            "", markdown_table(rows)]
    return "\n".join(head)


def render_markdown(d: Data, plots: list[str]) -> str:
    runs = d.doc.get("runs", [])
    parts = ["# normkit benchmark results", "", headline_preamble(d), "", headline_table(d), "",
             targets_section(d), "", cells_section(d), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    parts += [op_tables(d), jax_impls_section(d), "", memory_table(d), "", errors_section(d), "", method_section(d), "",
              "Runs: " + "; ".join(f"{r.get('run_id')} ({r.get('wall_s')} s, `{' '.join(r.get('argv', []))}`)"
                                   for r in runs), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Plots.


def make_plots(d: Data, out_dir: Path, stem: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 (no matplotlib: no plots)
        return []
    written = []
    copy = d.doc.get("copy", {}).get("tbps")
    x = list(range(len(d.shapes)))

    def finish(fig, name):
        path = out_dir / f"{stem}_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def xaxis(ax):
        ax.set_xticks(x)
        ax.set_xticklabels(d.shapes, rotation=60, ha="right", fontsize=7)

    for op in d.ops:
        for dtype in d.dtypes:
            fig, axes = plt.subplots(1, len(d.modes), figsize=(4.2 * len(d.modes), 4.2), squeeze=False)
            for ax, mode in zip(axes[0], d.modes):
                for c in d.columns:
                    ys = [(d.get(op, mode, dtype, s, *c) or {}).get("tbps") for s in d.shapes]
                    if any(y is not None for y in ys):
                        ax.plot(x, [y if y is not None else float("nan") for y in ys], marker="o", ms=3,
                                label=LABELS[c], lw=2.2 if c[0] == "normkit" else 1.0, color=COLORS[c])
                if copy:
                    ax.axhline(copy, ls="--", c="k", lw=0.8, label="copy")
                ax.set_title(f"{OP_TITLES[op]} {dtype} {mode}", fontsize=9)
                ax.set_ylabel("TB/s (byte model)")
                xaxis(ax)
            axes[0][0].legend(fontsize=6)
            finish(fig, f"bw_{op}_{dtype}")

    grid = [(op, dtype) for dtype in d.dtypes for op in d.ops]
    if grid:
        def grid_fig(name, ylabel, series):
            fig, axes = plt.subplots(len(d.dtypes), len(d.ops), figsize=(4.6 * len(d.ops), 3.8 * len(d.dtypes)),
                                     squeeze=False)
            drew = False
            for i, dtype in enumerate(d.dtypes):
                for j, op in enumerate(d.ops):
                    ax = axes[i][j]
                    for label, ys, color in series(op, dtype):
                        if any(y is not None for y in ys):
                            drew = True
                            ax.plot(x, [y if y is not None else float("nan") for y in ys], marker="o", ms=3,
                                    label=label, color=color)
                    ax.set_title(f"{OP_TITLES[op]} {dtype}", fontsize=9)
                    ax.set_ylabel(ylabel, fontsize=8)
                    xaxis(ax)
                    if ax.get_legend_handles_labels()[0]:
                        ax.legend(fontsize=6)
            if drew:
                finish(fig, name)
            else:
                plt.close(fig)

        def pct(op, dtype):
            for mode in d.modes:
                yield mode, [(d.get(op, mode, dtype, s, "normkit", "kernel") or {}).get("pct_copy")
                             for s in d.shapes], None

        def frozen_speedup(op, dtype):
            for c in d.columns:
                ys = []
                for s in d.shapes:
                    f, z = d.us(op, "bwd_full", dtype, s, *c), d.us(op, "bwd_frozen", dtype, s, *c)
                    ys.append(f / z if f and z else None)
                yield LABELS[c], ys, COLORS[c]

        def mem_saved(op, dtype):
            for c in d.columns:
                ys = []
                for s in d.shapes:
                    f, z = d.get(op, "bwd_full", dtype, s, *c), d.get(op, "bwd_frozen", dtype, s, *c)
                    fm, zm = (f or {}).get("peak_mem_bytes"), (z or {}).get("peak_mem_bytes")
                    ys.append((fm - zm) / 2**20 if fm is not None and zm is not None else None)
                yield LABELS[c], ys, COLORS[c]

        grid_fig("pct_copy", "normkit kernel, % of copy", pct)
        grid_fig("frozen_speedup", "bwd_full time / bwd_frozen time", frozen_speedup)
        grid_fig("memory_saved", "peak MiB saved by freezing", mem_saved)
    return written


# ---------------------------------------------------------------------------------------------


def rewrite_readme(readme: Path, d: Data, md_path: Path) -> bool:
    if readme is None or not readme.exists():
        return False
    text = readme.read_text()
    if START not in text or END not in text or text.index(START) > text.index(END):
        return False
    rel = os.path.relpath(md_path, readme.parent)
    block = "\n".join([START, "", headline_preamble(d), "", headline_table(d), "",
                       f"Full tables, targets, memory and plots: [{rel}]({rel}). Regenerate with "
                       "`python3 benchmarks/report.py benchmarks/results/h200.json`.", "", END])
    new = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    if new != text:
        readme.write_text(new)
    return True


def generate(json_path: Path, *, readme: Path | None = None, plots: bool = True) -> list[Path]:
    """Write the markdown report (and plots) next to ``json_path``; rewrite ``readme``'s markers."""
    json_path = Path(json_path)
    d = Data(json.loads(json_path.read_text()))
    out_dir, stem = json_path.parent, json_path.stem
    pngs = make_plots(d, out_dir, stem) if plots else []
    if not plots:  # keep plots made earlier (e.g. on the GPU machine) in the report
        pngs = sorted(out_dir.glob(f"{stem}_*.png"))
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(render_markdown(d, [str(p) for p in pngs]))
    written = [md_path] + list(pngs if plots else [])
    if readme is not None and rewrite_readme(Path(readme), d, md_path):
        written.append(Path(readme))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--readme", type=Path, default=None, help="README with bench markers to rewrite")
    p.add_argument("--no-plots", action="store_true", help="keep existing PNGs, make none")
    args = p.parse_args(argv)
    for path in generate(args.json, readme=args.readme, plots=not args.no_plots):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
