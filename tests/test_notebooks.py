"""Every notebook runs, from its jupytext source, at smoke size; the committed .ipynb matches its source.

The notebooks assert their own claims (gradients within tolerance, dW-free launches, matching
losses), so a notebook that runs to the end has checked them. notebooks/build.py does the work:
jupytext reads the py:percent source, nbclient runs it in a fresh ``python3`` kernel (this interpreter).
"""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import jupytext
import nbformat
import pytest

from normkit.shapes import shapes as named_shapes

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
_spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS_DIR / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SOURCES = build.sources()
COMMITTED_RESULTS = ROOT / "benchmarks" / "results" / "h200.json"


def test_there_are_notebooks():
    assert [p.stem for p in SOURCES] == ["01_frozen_vs_full", "02_performance", "03_lora_finetune",
                                        "04_triton_vs_pallas", "05_multi_gpu_collectives"]


def _synthetic_results(out):
    """A results file in bench.py's schema (normkit-bench/1), with made-up timings, marked dry_run.

    Used only when no real results are committed, so that notebook 02's plotting code still runs.
    """
    rnd = random.Random(0)
    impls = [("normkit", "kernel"), ("normkit", "e2e"), ("normkit_jax", "e2e"), ("liger", "e2e"),
             ("torch_eager", "e2e"), ("torch_compile", "e2e"), ("xla", "e2e")]
    records = []
    for shape in named_shapes("bench")[:3] + named_shapes("model")[:1]:
        for op in ("rms_norm", "layer_norm", "fused_add_rms_norm"):
            for dtype, s in (("bf16", 2), ("fp32", 4)):
                for mode in ("fwd", "bwd_full", "bwd_frozen", "fwd_bwd"):
                    nbytes = {"fwd": 2, "bwd_full": 3, "bwd_frozen": 3, "fwd_bwd": 5}[mode] * shape.M * shape.N * s
                    for impl, path in impls:
                        us = nbytes / (rnd.uniform(1.5, 4.2) * 1e12) * 1e6
                        torch_side = impl in ("normkit", "liger", "torch_eager", "torch_compile")
                        records.append({
                            "op": op, "mode": mode, "dtype": dtype, "shape": shape.name, "M": shape.M, "N": shape.N,
                            "impl": impl, "path": path, "median_us": us, "bytes": nbytes,
                            "tbps": nbytes / us / 1e6, "pct_copy": 100 * nbytes / us / 1e6 / 4.27,
                            "peak_mem_bytes": int(nbytes * rnd.uniform(1, 1.5)) if torch_side and mode != "fwd" else None,
                            "error": None, "speedup_vs": None, "run_id": 0, "timer": "synthetic", "n_sets": 1,
                            "measured_as": None,
                            "extra": {"partial_bytes": 264 * shape.N * 4} if path == "kernel" else {},
                        })
    doc = {"schema": "normkit-bench/1", "device": {"name": "synthetic test fixture", "sms": 132},
           "versions": {}, "copy": {"tbps": 4.27}, "byte_model": {},
           "runs": [{"run_id": 0, "dry_run": True}], "records": records}
    out.write_text(json.dumps(doc))


def _outputs(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_executes_at_smoke_size(source, tmp_path, monkeypatch):
    synthetic = source.stem.startswith("02_") and not COMMITTED_RESULTS.exists()
    if synthetic:
        _synthetic_results(tmp_path / "h200.json")
        monkeypatch.setenv("NORMKIT_BENCH_RESULTS", str(tmp_path / "h200.json"))
    nb = build.execute(source, size="smoke")  # raises CellExecutionError on the first failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "size: smoke" in text
    if source.stem.startswith("02_"):
        assert len(_outputs(nb, "image/png")) >= 4  # bandwidth (2 dtypes), share, speedup, memory
        if synthetic:
            assert "dry-run" in text


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_committed_notebook_matches_its_source(source):
    """The .ipynb beside each source holds the same cells, executed (rebuild: python notebooks/build.py)."""
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run python notebooks/build.py"
    committed = nbformat.read(paired, as_version=4)
    expected = jupytext.read(source)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in expected.cells], (
        f"{paired.name} is out of date with {source.name}: run python notebooks/build.py {source.stem[:2]}")
    assert all(c.execution_count is not None for c in committed.cells if c.cell_type == "code"), (
        f"{paired.name} was not executed")
