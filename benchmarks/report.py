"""Turn a bench.py results JSON into a Markdown report, and the README's table.

    python3 benchmarks/report.py benchmarks/results/h200_cells.json [--readme README.md]

Writes ``<stem>.md`` next to the JSON: where the numbers come from, the Torch cells (normkit through
autograd against the fastest Torch peer in each), per-op tables of every implementation, peak memory,
errors and method; tables through ``pandas.DataFrame.to_markdown`` (needs tabulate). With ``--readme``
it rewrites the part of that README between ``<!-- bench:start -->`` and ``<!-- bench:end -->``
(both markers must be there) with the cells as one table and the run's device, date and commit.
Notebook 02 draws the figures of a results file.
"""
from __future__ import annotations

import argparse
import json
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
TORCH_PEERS = ("liger", "torch_eager", "torch_compile")
# (impl, path) columns in display order, and their labels.
LABELS = {("normkit", "kernel"): "normkit kernel", ("normkit", "e2e"): "normkit (torch)",
          ("normkit_jax", "e2e"): "normkit (jax)", ("normkit_jax_pallas", "e2e"): "normkit (jax, pallas)",
          ("normkit_jax_xla", "e2e"): "normkit (jax, xla)", ("liger", "e2e"): "Liger",
          ("torch_eager", "e2e"): "torch eager", ("torch_compile", "e2e"): "torch.compile", ("xla", "e2e"): "XLA jit"}
# The cells of the Torch end-to-end comparison: 3 ops x 3 modes x these (dtype, M x N): 81 in all.
CELL_MODES = ("fwd", "bwd_full", "bwd_frozen")
CELL_SHAPES = [("bf16", s) for s in ("4096x1024", "4096x4096", "8192x4096", "8192x8192", "16384x8192",
                                     "32768x4096", "65536x2048")] + [("fp32", "8192x8192"), ("fp32", "32768x4096")]


def markdown_table(rows: list[dict]) -> str:
    """A Markdown table of ``rows`` (one dict per row, its keys the columns), cells as given: the one
    table renderer of the reports (``pandas.DataFrame.to_markdown``, through tabulate)."""
    import pandas as pd

    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)


class Data:
    def __init__(self, doc: dict):
        self.doc = doc
        self.records = doc.get("records", [])
        self.by_key = {(r["op"], r["mode"], r["dtype"], r["shape"], r["impl"], r["path"]): r for r in self.records}
        self.dims = {r["shape"]: (r["M"], r["N"]) for r in self.records if r.get("measured_as") is None}
        self.shapes = sorted(self.dims, key=lambda s: (self.dims[s][0] * self.dims[s][1], self.dims[s]))  # by size
        self.dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in self.records)]
        self.ops = [o for o in OPS if any(r["op"] == o for r in self.records)]
        self.modes = [m for m in MODES if any(r["mode"] == m for r in self.records)]
        self.columns = [c for c in LABELS if any((r["impl"], r["path"]) == c for r in self.records)]

    def get(self, op, mode, dtype, shape, impl, path="e2e"):
        r = self.by_key.get((op, mode, dtype, shape, impl, path))
        return r if r is not None and r.get("median_us") else None

    def us(self, *key):
        r = self.get(*key)
        return r["median_us"] if r else None

    def cell(self, op, mode, dtype, shape) -> tuple[float | None, str | None, float | None]:
        """(normkit's e2e µs, the fastest Torch peer, its µs) in one cell."""
        peers = {p: u for p in TORCH_PEERS if (u := self.us(op, mode, dtype, shape, p))}
        best = min(peers, key=peers.get) if peers else None
        return self.us(op, mode, dtype, shape, "normkit"), best, peers.get(best)

    def provenance(self, records=None) -> str:
        """The device, dates, commits, copy bandwidth and versions of the runs that made ``records``."""
        ids = {r["run_id"] for r in (self.records if records is None else records)}
        runs = [r for r in self.doc.get("runs", []) if r.get("run_id") in ids] or self.doc.get("runs", [])[-1:]
        if not runs:
            return "Runs not recorded."
        v = runs[-1].get("versions", {})
        stack = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "jax", "liger-kernel") if v.get(k))
        commits = ", ".join(dict.fromkeys(f"{r['versions'].get('git')}" + ("-dirty" if r["versions"].get("git_dirty")
                                                                           else "") for r in runs))
        dates = ", ".join(dict.fromkeys(str(r.get("started", "?"))[:10] for r in runs))
        copy = runs[-1].get("copy", {}).get("tbps")
        return (f"{runs[-1].get('device', {}).get('name', '?')}, {dates}, commit {commits}"
                + (f" ({len(runs)} runs)" if len(runs) > 1 else "") + f"; {stack}"
                + (f"; copy bandwidth {copy:.2f} TB/s (read + write), measured in the same run" if copy else "") + ".")


def _fmt_us(us):
    return "—" if us is None else (f"{us:.1f}" if us < 1000 else f"{us:.0f}")


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


def readme_table(d: Data) -> str:
    """The cells as one table: per op and mode (rows) and (dtype, shape) (columns), normkit's median µs
    and the fastest Torch peer's time over it (≥ 1×: normkit is at least as fast)."""
    rows = []
    for op in OPS:
        for mode in CELL_MODES:
            row = {"op": OP_TITLES[op], "mode": mode}
            for dtype, shape in CELL_SHAPES:
                nk, _, best = d.cell(op, mode, dtype, shape)
                row[f"{dtype} {shape}"] = _fmt_us(nk) + (f" ({best / nk:.2f}×)" if nk and best else "")
            rows.append(row)
    return markdown_table(rows)


def cells_section(d: Data) -> str:
    """Every cell: normkit through torch (autograd, end to end) against the fastest Torch peer in it."""
    rows, won, missing = [], 0, 0
    for op in OPS:
        for mode in CELL_MODES:
            for dtype, shape in CELL_SHAPES:
                nk, best, best_us = d.cell(op, mode, dtype, shape)
                cell = {"op": OP_TITLES[op], "mode": mode, "cell": f"{dtype} {shape}"}
                if nk is None or best is None:
                    missing += 1
                    rows.append({**cell, "normkit": _fmt_us(nk) if nk else "not measured",
                                 "best peer": "" if best else "—", "best ÷ normkit": "—", "fastest": "—"})
                    continue
                ratio = best_us / nk  # > 1: normkit is faster
                won += ratio >= 1.0
                rows.append({**cell, "normkit": _fmt_us(nk), "best peer": f"{best} {_fmt_us(best_us)}",
                             "best ÷ normkit": f"{ratio:.2f}×" + ("" if ratio >= 1.0 else " (slower)"),
                             "fastest": "normkit" if ratio >= 1.0 else best})
    total = len(OPS) * len(CELL_MODES) * len(CELL_SHAPES)
    return "\n".join([
        f"## Torch end to end, cell by cell: normkit is at least as fast as the best peer in {won} of "
        f"{total - missing} measured cells ({missing} of {total} not measured)", "",
        "Times are medians in µs through `torch.autograd` (forward, full backward, frozen backward), peers "
        f"{', '.join(TORCH_PEERS)}; the ratio is the best peer's time over normkit's (≥ 1× means normkit wins).",
        "", markdown_table(rows)])


def op_tables(d: Data) -> str:
    out = []
    for op in d.ops:
        out.append(f"## {OP_TITLES[op]}")
        for dtype in d.dtypes:
            out += ["", f"### {OP_TITLES[op]}, {dtype}: median µs (% of copy); **bold**: fastest end to end", ""]
            rows = []
            for s in d.shapes:
                for mode in d.modes:
                    best = min((u for c in d.columns if c[1] == "e2e" and (u := d.us(op, mode, dtype, s, *c))),
                               default=None)
                    rows.append({"shape": f"{s} ({d.dims[s][0]}×{d.dims[s][1]})", "mode": mode,
                                 **{LABELS[c]: _time_cell(d, op, mode, dtype, s, *c, best=best if c[1] == "e2e"
                                                          else None) for c in d.columns}})
            out.append(markdown_table(rows))
        out.append("")
    return "\n".join(out)


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
    out = ["## Errors and gaps", ""]
    for run in d.doc.get("runs", []):
        out += [f"- run {run.get('run_id')}: {k}: {v}" for k, v in run.get("peers", {}).items()
                if not str(v).startswith("ok")]
    measured = [r for r in d.records if r.get("error") and not r.get("measured_as")]
    skipped = sum(r["error"].startswith("skipped") for r in measured)
    if skipped:
        out.append(f"- {skipped} measurements skipped because the time budget ran out (rerun with "
                   "`--merge <json> --skip-done`).")
    errs: dict = {}
    for r in measured:
        if not r["error"].startswith("skipped"):
            errs.setdefault((r["impl"], r["path"]), []).append(r)
    for (impl, path), rs in sorted(errs.items()):
        out.append(f"- {impl} {path}: {len(rs)} errors, e.g. {rs[0]['op']} {rs[0]['mode']} {rs[0]['dtype']} "
                   f"{rs[0]['shape']}: `{rs[0]['error'][:300]}`")
    return "\n".join(out + ["- none"] * (len(out) == 2))


def method_section(d: Data) -> str:
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
    for op, modes in d.doc.get("byte_model", {}).items():
        lines += [f"- {OP_TITLES.get(op, op)} {mode}: " + ", ".join(terms) for mode, terms in modes.items()]
    return "\n".join(lines)


def render_markdown(d: Data) -> str:
    runs = d.doc.get("runs", [])
    return "\n".join(["# normkit benchmark results", "", d.provenance(), "", cells_section(d), "", op_tables(d),
                      memory_table(d), "", errors_section(d), "", method_section(d), "",
                      "Runs: " + "; ".join(f"{r.get('run_id')} ({r.get('wall_s')} s, `{' '.join(r.get('argv', []))}`)"
                                           for r in runs), ""])


def rewrite_readme(readme: Path, d: Data, md_path: Path, json_path: Path) -> bool:
    """Rewrite the README's table between its markers; False (nothing written) without both markers."""
    text = readme.read_text() if readme.exists() else ""
    if START not in text or END not in text or text.index(START) > text.index(END):
        return False
    rel, src = (os.path.relpath(p, readme.parent) for p in (md_path, json_path))
    cells = [r for r in d.records if (r["dtype"], r["shape"]) in CELL_SHAPES and r["mode"] in CELL_MODES]
    timed = [(nk, best) for op in OPS for mode in CELL_MODES for dtype, shape in CELL_SHAPES
             for nk, _, best in [d.cell(op, mode, dtype, shape)] if nk and best]
    block = "\n".join([
        START, "", f"{d.provenance(cells)} normkit is at least as fast as the fastest peer in "
        f"{sum(best >= nk for nk, best in timed)} of the {len(timed)} cells measured.", "",
        "Median µs of one call through `torch.autograd` (fwd: inference forward under `no_grad`; bwd_full, "
        "bwd_frozen: the backward alone, weight and bias trained or frozen), and in brackets the fastest of "
        f"{', '.join(TORCH_PEERS)} over it (≥ 1×: normkit is at least as fast).", "", readme_table(d), "",
        f"Every cell with its peers, per-op tables with % of copy bandwidth (byte model: "
        f"benchmarks/bytemodel.py), memory: [{rel}]({rel}). Regenerate with "
        f"`python3 benchmarks/report.py {src} --readme README.md`.", "", END])
    new = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    if new != text:
        readme.write_text(new)
    return True


def generate(json_path: Path, *, readme: Path | None = None) -> list[Path]:
    """Write the Markdown report next to ``json_path``; rewrite ``readme``'s table."""
    json_path = Path(json_path)
    d = Data(json.loads(json_path.read_text()))
    md_path = json_path.with_suffix(".md")
    md_path.write_text(render_markdown(d))
    return [md_path] + ([Path(readme)] if readme and rewrite_readme(Path(readme), d, md_path, json_path) else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--readme", type=Path, default=None, help="README whose table to rewrite (between its markers)")
    args = p.parse_args(argv)
    for path in generate(args.json, readme=args.readme):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
