"""The notebooks: each runs from its jupytext source at smoke size and draws its figures; the committed
.ipynb match their sources, each with a figure and no error; figure captions name their source.

The notebooks assert their own claims (gradients within tolerance, dW-free launches, matching
losses, collectives counted), so a notebook that runs to the end has checked them. notebooks/build.py
does the work: jupytext reads the py:percent source, nbclient runs it in a fresh ``python3`` kernel
(this interpreter).
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
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
# Figures each notebook draws at smoke size on a CPU (most from the committed GPU results).
FIGURES = {"01_frozen_vs_full": 3, "02_performance": 5, "03_lora_finetune": 3, "04_triton_vs_pallas": 4,
           "05_multi_gpu_collectives": 1, "06_flax_nnx": 1}
# stderr a notebook may print: JAX's note, on a machine with an NVIDIA driver but CPU jaxlib, that it
# falls back to the CPU (the same line pyproject.toml's filterwarnings lets through).
ALLOWED_STDERR = re.compile(r"An NVIDIA GPU may be present on this machine")


def test_there_are_notebooks():
    assert [p.stem for p in SOURCES] == list(FIGURES)


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


def _errors(nb):
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


def _stderr(nb):
    return [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "stream" and o.name == "stderr" and not ALLOWED_STDERR.search(o.text)]


@pytest.mark.slow  # every notebook end to end, about 2 minutes of CPU: the slow tier
@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_executes_at_smoke_size(source, tmp_path, monkeypatch, user_xla_flags):
    # user_xla_flags: the kernel starts with the user's XLA_FLAGS (05 sets its own where there are none)
    synthetic = source.stem.startswith("02_") and not COMMITTED_RESULTS.exists()
    if synthetic:
        _synthetic_results(tmp_path / "h200.json")
        monkeypatch.setenv("NORMKIT_BENCH_RESULTS", str(tmp_path / "h200.json"))
    nb = build.execute(source, size="smoke")  # raises CellExecutionError on the first failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    assert not _errors(nb)
    assert not _stderr(nb), "\n".join(_stderr(nb))  # warnings (matplotlib, pandas, ...) show here
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "size: smoke" in text
    figures = len(_outputs(nb, "image/png"))
    assert figures >= FIGURES[source.stem], f"{source.stem} drew {figures} figures, expected {FIGURES[source.stem]}"
    assert len(_outputs(nb, "text/html")) >= 1  # its tables, as DataFrames
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


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_committed_notebook_has_figures_and_no_errors(source):
    committed = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    assert not _errors(committed)
    assert len(_outputs(committed, "image/png")) >= 1, f"{source.stem}.ipynb has no figure"


def test_a_smoke_build_never_replaces_the_committed_notebooks(tmp_path, monkeypatch):
    """build.py at smoke size writes to build/notebooks/ (or --out), never beside the sources, whose
    .ipynb hold the full-size GPU outputs; only a full-size build writes there."""
    source = SOURCES[0]
    committed = source.with_suffix(".ipynb").read_bytes()
    ran = []

    def execute(src, size, timeout=600):  # the notebook itself is run by the tests above
        ran.append((src, size))
        return jupytext.read(src)

    monkeypatch.setattr(build, "execute", execute)
    monkeypatch.setattr(build, "SMOKE_OUT", tmp_path / "smoke")
    assert build.main([source.stem[:2], "--size", "smoke"]) == 0
    assert ran == [(source, "smoke")] and (tmp_path / "smoke" / f"{source.stem}.ipynb").exists()
    monkeypatch.setenv("NORMKIT_NOTEBOOK_SIZE", "smoke")  # the size the machine picks, given by the variable
    assert build.main([source.stem[:2], "--out", str(tmp_path / "elsewhere")]) == 0
    assert ran[-1] == (source, "smoke") and (tmp_path / "elsewhere" / f"{source.stem}.ipynb").exists()
    assert source.with_suffix(".ipynb").read_bytes() == committed
    assert build.output_dir("full", None) == source.parent and build.output_dir("smoke", None) == build.SMOKE_OUT


# ---------------------------------------------------------------------------------------------
# notebooks/_nbutil.py: where each figure's numbers come from


@pytest.fixture
def nbutil(monkeypatch):
    monkeypatch.syspath_prepend(str(NOTEBOOKS_DIR))
    sys.modules.pop("_nbutil", None)
    import _nbutil

    return _nbutil


def test_source_label_reads_the_files_metadata(nbutil, tmp_path):
    doc = {"device": {"name": "Some GPU"}, "versions": {"git": "abc1234", "git_dirty": True},
           "runs": [{"started": "2031-02-03T04:05:06+00:00"}, {"started": "2031-02-05T00:00:00+00:00"}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    label = nbutil.Source.of(path).label()
    assert label.startswith("Some GPU, 2031-02-03 to 2031-02-05, commit abc1234 with local changes")
    assert label.endswith(str(path)) and "git log" not in label


def test_source_label_says_what_the_file_lacks(nbutil, tmp_path):
    path = tmp_path / "r.json"  # outside the repository: git knows nothing of it either
    path.write_text(json.dumps({"env": {"device_name": "Other GPU"}}))
    assert nbutil.Source.of(path).label(with_name=False) == "Other GPU, date not recorded, commit not recorded"


def test_source_label_falls_back_to_git(nbutil, tmp_path, monkeypatch):
    asked = []

    def git(*args):  # git log lists the newest commit first, the one that added the file last
        asked.append(args)
        if args[0] == "log":
            assert args[-1] == str(path.resolve()) and "--diff-filter=A" in args
            return "cafe456\nfeed123"
        return {"abc1234": "2030-01-02", "feed123": "2030-03-04"}[args[-1]]  # git show -s --format=%cs COMMIT

    monkeypatch.setattr(nbutil, "_git", git)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"env": {"device_name": "Some GPU", "versions": {"git": "abc1234"}}}))
    source = nbutil.Source.of(path)  # the LoRA-step schema: a commit but no date
    assert (source.date, source.date_from_git) == ("2030-01-02", True)
    assert (source.commit, source.commit_from_git) == ("abc1234", False)
    assert source.label(with_name=False) == "Some GPU, 2030-01-02 (the file records no date: its commit's), commit abc1234"
    path.write_text(json.dumps({"device": "Some GPU"}))  # neither a date nor a commit
    assert nbutil.Source.of(path).label(with_name=False) == (
        "Some GPU, 2030-03-04 (the file records no date: its commit's), added to the repository in feed123 (the file "
        "records no commit)")
    assert [a[0] for a in asked] == ["show", "log", "show"]


def test_this_run_on_a_cpu_says_it_measures_no_speed(nbutil):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert "says nothing about speed" not in nbutil.this_run("full")
    else:
        assert nbutil.this_run("smoke").endswith("says nothing about speed")
