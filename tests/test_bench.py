"""The benchmark's own checks: the byte model against hand counts, the report's arithmetic on a
made-up results file, and a CPU dry run of benchmarks/bench.py end to end (JSON, report, README); the
LoRA-step benchmarks' dry runs (lora_step.py, nnx_lora_step.py). The only test file that may import a
benchmark module or run a benchmark script."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import bytemodel, report
from benchmarks.timing import MAX_SETS, ROTATE_BYTES, Timer, num_sets
from tests.test_scripts import run_script  # the tools' dry runs, as a user runs them

REPO = Path(__file__).resolve().parents[1]
RECORD_KEYS = {"op", "mode", "dtype", "shape", "M", "N", "impl", "path", "median_us", "bytes", "tbps", "pct_copy",
               "peak_mem_bytes", "error", "run_id", "timer", "n_sets", "measured_as", "extra"}


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``markdown``, as lists of stripped cells."""
    lines = [line.strip() for line in markdown.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def row_of(markdown: str, *first: str) -> list[str]:
    """The cells of the table row of ``markdown`` whose first cells are ``first``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith("|")]
    return next(row for row in rows if row[:len(first)] == list(first))


# ---------------------------------------------------------------------------------------------
# Byte model: hand counts (bf16: 2 bytes per element, the weight in bf16 too; fp32 statistics).


@pytest.mark.parametrize("M,N", [(8192, 8192), (32768, 4096), (3, 5)])
def test_byte_model_hand_counts(M, N):
    b = 2
    # RMSNorm forward: read x, write y (M*N each), read the weight (N).
    assert bytemodel.bytes_moved("rms_norm", "fwd", M, N, b) == 2 * M * N * 2 + 2 * N
    # Frozen backward: read x and dy, write dx; read the weight and the fp32 rstd; no dW.
    assert bytemodel.bytes_moved("rms_norm", "bwd_frozen", M, N, b) == 3 * M * N * 2 + 2 * N + 4 * M
    # Full backward adds the dW write.
    assert bytemodel.bytes_moved("rms_norm", "bwd_full", M, N, b) == 3 * M * N * 2 + 2 * N + 2 * N + 4 * M
    # LayerNorm: the bias read forward; mean and rstd read backward; dW and dB written.
    assert bytemodel.bytes_moved("layer_norm", "fwd", M, N, b) == 2 * M * N * 2 + 2 * 2 * N
    assert bytemodel.bytes_moved("layer_norm", "bwd_full", M, N, b) == 3 * M * N * 2 + 3 * 2 * N + 8 * M
    assert bytemodel.bytes_moved("layer_norm", "bwd_frozen", M, N, b) == 3 * M * N * 2 + 2 * N + 8 * M
    # Fused add: x and residual read, y and residual_out written; backward reads s, dy, ds, writes dx once.
    assert bytemodel.bytes_moved("fused_add_rms_norm", "fwd", M, N, b) == 4 * M * N * 2 + 2 * N
    assert bytemodel.bytes_moved("fused_add_rms_norm", "bwd_frozen", M, N, b) == 4 * M * N * 2 + 2 * N + 4 * M
    # Training forward (statistics written) then the full backward.
    assert bytemodel.bytes_moved("rms_norm", "fwd_bwd", M, N, b) == (2 * M * N * 2 + 2 * N + 4 * M) + (
        3 * M * N * 2 + 4 * N + 4 * M)


def test_byte_model_fp32_doubles_the_tensor_terms():
    M, N = 4096, 1024
    for op in bytemodel.OPS:
        for mode in bytemodel.MODES:
            t2 = bytemodel.terms(op, mode, M, N, 2)
            t4 = bytemodel.terms(op, mode, M, N, 4)
            for name, v in t2.items():
                expected = v if ("rstd" in name or "mean" in name) else 2 * v
                assert t4[name] == expected, (op, mode, name)


def test_rotation_exceeds_l2_or_caps():
    assert num_sets(300 * 2**20) == 1
    assert num_sets(8 * 2**20) == min(MAX_SETS, 25)
    for nbytes in (2**20, 16 * 2**20, 64 * 2**20, 100 * 2**20, 199 * 2**20):
        k = num_sets(nbytes)
        assert k == MAX_SETS or k * nbytes >= ROTATE_BYTES


def test_loop_rotates_inputs_and_times_per_call():
    """Timer.loop: call(i) with i = 0, 1, 2, ... (the input set), ``sync`` given the last result at each
    block's end, and the median time of one call, not of a block: every call sleeps at least 2 ms."""
    seen, synced = [], []

    def call(i):
        seen.append(i)
        time.sleep(0.002)
        return i

    us = Timer(warmup_ms=0, rep_ms=30, batches=3).loop(call, synced.append)
    assert seen == list(range(len(seen))) and len(seen) >= 3 * 3, seen
    assert synced and synced[-1] == seen[-1] and set(synced) <= set(seen), synced
    assert 2000 <= us < 2000 * len(seen), us
    assert Timer(dry=True).loop(call, synced.append) >= 2000
    times = Timer.each(lambda: time.sleep(0.002), 3, lambda _: None)
    assert len(times) == 3 and min(times) >= 2000, times


def test_device_time_needs_a_gpu():
    """Timer.device in a dry run (no GPU to time): None, not a number that would mean nothing."""
    assert Timer(dry=True).device(lambda: None) is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="times the GPU")
def test_device_time_is_the_gpus_own():
    """Timer.device on a GPU: the device time of a 256 MiB copy is the copy's alone, not above do_bench's
    time of the same copy (which adds launch gaps) and not below what the byte count allows at 10 TB/s,
    above any current GPU's memory bandwidth; a call that launches nothing on the GPU is an error, not
    a zero."""
    import torch

    src = torch.empty(2**27, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    timer = Timer(warmup_ms=5, rep_ms=20)
    device_us, kernel_us = timer.device(lambda: dst.copy_(src)), timer.kernel(lambda: dst.copy_(src))
    assert 2 * src.nbytes / 10e12 * 1e6 <= device_us <= 1.1 * kernel_us, (device_us, kernel_us)
    with pytest.raises(RuntimeError, match="no GPU activity"):
        timer.device(lambda: None)


def test_shape_strings():
    from normkit.shapes import parse, parse_list

    assert parse("8192x4096") == (8192, 4096) and parse(" 3X5 ") == (3, 5)
    assert parse_list("8x64,32768x4096,") == [(8, 64), (32768, 4096)]
    for bad in ("8192", "8x0", "ax4", "2x3x4", "-1x4"):
        with pytest.raises(ValueError, match=f"shape {bad!r} is not MxN"):
            parse(bad)


def test_llama_lora_trains_the_adapters_only():
    from benchmarks.models import Unavailable, llama_lora, norm_modules, swap_norms

    model, info = llama_lora(layers=1, hidden=32, heads=2, vocab=64, intermediate=64, r=4,
                             targets=("q_proj", "v_proj"), norms="normkit")
    assert info["patched"] == 3 and info["fused"] == 0, info  # the layer's two norms and the final one
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted({n.split(".")[-4] for n in trained}) == ["q_proj", "v_proj"], trained
    assert all(".lora_A." in n or ".lora_B." in n for n in trained), trained
    norms = norm_modules(model)
    assert {type(m).__name__ for _, m in norms} == {"HFRMSNorm"} and len(norms) == 3
    assert all(not m.weight.requires_grad and not bool((m.weight == 1).all()) for _, m in norms)
    with pytest.raises(ValueError, match="unknown norms 'apex'"):
        swap_norms(model, "apex")
    with pytest.raises(Unavailable):  # Liger's Triton kernels: a GPU (and liger-kernel) only
        swap_norms(model, "liger")


@pytest.mark.parametrize("adapter_dtype, expected", [("float32", "float32"), ("model", "bfloat16")])
def test_llama_lora_adapter_dtype(adapter_dtype, expected):
    """PEFT's default gives a bf16 model fp32 adapters; ``adapter_dtype="model"`` keeps them in bf16."""
    import torch

    from benchmarks.models import llama_lora

    expected = getattr(torch, expected)
    model, _ = llama_lora(layers=1, hidden=32, heads=2, vocab=64, intermediate=64, r=4, targets=("q_proj",),
                          dtype=torch.bfloat16, adapter_dtype=adapter_dtype)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {expected}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    with pytest.raises(ValueError, match="adapter_dtype must be"):
        llama_lora(layers=1, hidden=32, heads=2, vocab=64, adapter_dtype="fp16")


# ---------------------------------------------------------------------------------------------
# The report's arithmetic on a made-up file.


def _rec(op, mode, shape, M, N, impl, path, us, copy_tbps=4.0, **kw):
    nbytes = bytemodel.bytes_moved(op, mode, M, N, 2)
    tbps = nbytes / (us * 1e-6) / 1e12
    return {"op": op, "mode": mode, "dtype": "bf16", "shape": shape, "M": M, "N": N, "impl": impl, "path": path,
            "median_us": us, "bytes": nbytes, "tbps": tbps, "pct_copy": 100 * tbps / copy_tbps,
            "peak_mem_bytes": kw.get("peak"), "error": None, "run_id": "r", "timer": "t",
            "n_sets": 1, "measured_as": None, "extra": kw.get("extra", {})}


def test_report_readme_table_and_its_provenance(tmp_path):
    """The README's table: normkit's time and the fastest Torch peer's over it, per cell; the runs'
    device, date and commit above it; the rest of the README untouched."""
    recs = []
    for shape, (M, N), nk, liger, compile_ in (("8192x4096", (8192, 4096), 100.0, 150.0, 200.0),
                                               ("16384x8192", (16384, 8192), 100.0, 400.0, 90.0)):
        recs += [_rec("rms_norm", "bwd_frozen", shape, M, N, "normkit", "kernel", nk * 0.9),
                 _rec("rms_norm", "bwd_frozen", shape, M, N, "normkit", "e2e", nk),
                 _rec("rms_norm", "bwd_frozen", shape, M, N, "liger", "e2e", liger),
                 _rec("rms_norm", "bwd_frozen", shape, M, N, "torch_compile", "e2e", compile_)]
    run = {"run_id": "r", "started": "2031-02-03T04:05:06+00:00", "peers": {"liger": "unavailable: no GPU"},
           "device": {"name": "test GPU"}, "versions": {"git": "abc1234", "git_dirty": False, "torch": "9.9"},
           "copy": {"tbps": 4.0}}
    doc = {"schema": "normkit-bench/1", "device": {"name": "test GPU"}, "versions": {}, "copy": {"tbps": 4.0},
           "byte_model": {}, "runs": [run], "records": recs}
    d = report.Data(doc)
    row = row_of(report.readme_table(d), "RMSNorm", "bwd_frozen")
    assert row[2:] == ["—", "—", "100.0 (1.50×)", "—", "100.0 (0.90×)", "—", "—", "—", "—"]  # best peer ÷ normkit
    assert row_of(report.readme_table(d), "LayerNorm", "fwd")[2:] == ["—"] * 9
    md = report.render_markdown(d)
    assert "liger: unavailable: no GPU" in md
    assert md.splitlines()[2].startswith("test GPU, 2031-02-03, commit abc1234; torch 9.9; copy bandwidth 4.00 TB/s")
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{report.START}\nold table\n{report.END}\nafter\n")
    (tmp_path / "r.json").write_text(json.dumps(doc))
    report.generate(tmp_path / "r.json", readme=readme)
    text = readme.read_text()
    assert "old table" not in text and "before\n" in text and text.endswith("after\n")
    assert row_of(text, "RMSNorm", "bwd_frozen") == row and "[r.md](r.md)" in text
    assert "test GPU, 2031-02-03, commit abc1234" in text and "report.py r.json --readme README.md" in text
    no_markers = tmp_path / "OTHER.md"
    no_markers.write_text("nothing to replace\n")
    assert not report.rewrite_readme(no_markers, d, tmp_path / "r.md", tmp_path / "r.json")
    assert no_markers.read_text() == "nothing to replace\n"


def test_report_cells_against_the_best_peer():
    """The 81-cell table: each cell against its fastest Torch peer; wins, losses and unmeasured cells."""
    recs = [_rec("rms_norm", "fwd", "4096x1024", 4096, 1024, "normkit", "e2e", 50.0),
            _rec("rms_norm", "fwd", "4096x1024", 4096, 1024, "torch_eager", "e2e", 40.0),
            _rec("rms_norm", "fwd", "4096x1024", 4096, 1024, "liger", "e2e", 60.0),
            _rec("rms_norm", "bwd_frozen", "8192x8192", 8192, 8192, "normkit", "e2e", 100.0),
            _rec("rms_norm", "bwd_frozen", "8192x8192", 8192, 8192, "torch_compile", "e2e", 150.0)]
    d = report.Data({"records": recs})
    sec = report.cells_section(d)
    assert sec.startswith("## Torch end to end, cell by cell: normkit is at least as fast as the best peer in 1 of "
                          "2 measured cells (79 of 81 not measured)"), sec.splitlines()[0]
    rows = {tuple(row[:3]): row for row in table_rows(sec)}
    assert len(rows) == 81 and sum(op == "RMSNorm" for op, _, _ in rows) == 27  # 3 modes x 9 (dtype, shape)
    assert rows["RMSNorm", "fwd", "bf16 4096x1024"][4:] == ["torch_eager 40.0", "0.80× (slower)", "torch_eager"]
    assert rows["RMSNorm", "bwd_frozen", "bf16 8192x8192"][4:] == ["torch_compile 150.0", "1.50×", "normkit"]
    assert rows["RMSNorm", "bwd_full", "fp32 32768x4096"][3] == "not measured"


def test_peer_selection_names_the_jax_implementations():
    from benchmarks import bench

    def peers(value):
        return bench.parse_args(["--dry-run", "--peers", value]).peers

    assert peers("jax-impls") == ["normkit_jax", "normkit_jax_pallas", "normkit_jax_xla"]
    assert peers("normkit_jax_pallas,normkit-jax-xla,xla") == ["normkit_jax_pallas", "normkit_jax_xla", "xla"]
    assert peers("normkit-jax-pallas,jax_impls") == ["normkit_jax_pallas", "normkit_jax", "normkit_jax_xla"]
    assert peers("none") == []
    assert set(bench.parse_args(["--dry-run"]).peers) == set(bench.ALL_PEERS) >= set(bench.NORMKIT_JAX)
    with pytest.raises(SystemExit):
        peers("mosaic")


# ---------------------------------------------------------------------------------------------
# A CPU dry run, end to end.


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_dry_run_writes_schema_report_and_readme(tmp_path):
    out = tmp_path / "results" / "dry.json"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.START}\n{report.END}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    # bf16 and two ops keep it fast; the fused add covers the two-output path.
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench.py"), "--dry-run", "--out", str(out), "--dtypes", "bf16",
           "--ops", "rms_norm,fused_add_rms_norm", "--readme", str(readme)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads(out.read_text())
    assert doc["schema"] == "normkit-bench/1"
    for key in ("device", "versions", "copy", "byte_model", "runs", "records"):
        assert key in doc
    assert doc["copy"]["tbps"] > 0 and doc["copy"]["bytes"] > 0
    run = doc["runs"][-1]
    assert run["dry_run"] is True
    assert set(run["peers"]) == {"normkit", "liger", "torch_eager", "torch_compile", "xla", "normkit_jax",
                                 "normkit_jax_pallas", "normkit_jax_xla"}
    # The JAX frontend's three implementations run on CPU (Triton and Pallas interpreted) and say which ran.
    for impl, which in (("normkit_jax", "triton"), ("normkit_jax_pallas", "pallas"), ("normkit_jax_xla", "xla")):
        assert run["peers"][impl] == f"ok (implementation {which})", run["peers"]

    recs = doc["records"]
    for r in recs:
        assert set(r) == RECORD_KEYS, set(r) ^ RECORD_KEYS
        assert r["bytes"] == bytemodel.bytes_moved(r["op"], r["mode"], r["M"], r["N"], 2)
        if r["error"] is None:
            assert r["median_us"] > 0
            tbps = r["bytes"] / (r["median_us"] * 1e-6) / 1e12
            assert r["tbps"] == pytest.approx(tbps, rel=1e-4)
            assert r["pct_copy"] == pytest.approx(100 * tbps / doc["copy"]["tbps"], rel=1e-4)
        else:
            assert r["median_us"] is None and isinstance(r["error"], str)

    # normkit itself must have run everywhere, both paths; torch eager too (no optional dependency).
    got = {(r["op"], r["mode"], r["impl"], r["path"]) for r in recs if r["error"] is None}
    for op in ("rms_norm", "fused_add_rms_norm"):
        for mode in bytemodel.MODES:
            for impl, path in (("normkit", "kernel"), ("normkit", "e2e"), ("torch_eager", "e2e"),
                               ("normkit_jax", "e2e"), ("normkit_jax_pallas", "e2e"), ("normkit_jax_xla", "e2e")):
                assert (op, mode, impl, path) in got, (op, mode, impl, path)
    # The hand count of the RMSNorm forward (read x and the weight, write y), on the dry-run shape.
    r = next(r for r in recs if (r["op"], r["mode"], r["impl"], r["path"]) == ("rms_norm", "fwd", "normkit", "kernel"))
    assert r["bytes"] == 2 * r["M"] * r["N"] * 2 + 2 * r["N"]
    # Every peer that imported left a record per mode; one that did not is explained in the run.
    for impl, status in run["peers"].items():
        rows = [r for r in recs if r["impl"] == impl]
        if status.startswith("ok"):
            assert {r["mode"] for r in rows} == set(bytemodel.MODES), impl
        else:
            assert not rows and status
    # The backward's partial buffer is recorded for the full backward only.
    kernel = {(r["op"], r["mode"]): r for r in recs if r["impl"] == "normkit" and r["path"] == "kernel"}
    assert kernel[("rms_norm", "bwd_full")]["extra"]["partial_bytes"] > 0
    assert kernel[("rms_norm", "bwd_frozen")]["extra"]["partial_bytes"] == 0

    md = out.with_suffix(".md").read_text()
    assert row_of(md, "op", "mode", "cell") and "\n## Torch end to end, cell by cell" in md
    table = md.split("### RMSNorm, bf16: median")[1]
    assert {"normkit (jax)", "normkit (jax, pallas)", "normkit (jax, xla)"} <= set(row_of(table, "shape", "mode"))
    text = readme.read_text()
    assert text.startswith("intro\n") and row_of(text, "RMSNorm", "fwd") and "dry run" in text


def test_cells_selects_exactly_the_table():
    """--cells: the 9 (dtype, shape) pairs x 3 modes of the Torch table, the Torch peers, nothing else."""
    from benchmarks import bench, report

    args = bench.parse_args(["--cells"])
    pairs = [(dtype, t.name) for t, dtype in bench.work_items(args, bench.select_targets(args))]
    assert sorted(pairs) == sorted(report.CELL_SHAPES)
    assert args.modes == list(report.CELL_MODES) and args.peers == list(report.TORCH_PEERS)
    assert len(args.ops) * len(args.modes) * len(pairs) == 81


@pytest.mark.slow
def test_host_ab_dry_run_alternates_trees_and_reports_every_case(tmp_path):
    """benchmarks/host_ab.py: each tree runs in its own process, importing its own copy; a row per
    case and tree, with positive times and their ratio."""
    from benchmarks import host_ab

    copy = tmp_path / "copy"
    copy.mkdir()
    for pkg in ("normkit", "torch_frontend"):
        subprocess.run(["cp", "-r", str(REPO / pkg), str(copy / pkg)], check=True)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "host_ab.py"), "--dry-run", "--rounds", "1",
           "--tree", f"a={REPO}", "--tree", f"b={copy}", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "host_ab.json").read_text())
    assert {(r["op"], r["call"], r["tree"]) for r in doc["rows"]} == {
        (op, kind, t) for op, kind in host_ab.CASES for t in ("a", "b")}
    for r in doc["rows"]:
        assert r["normkit_us"] > 0 and r["eager_us"] > 0
        assert r["ratio"] == pytest.approx(r["normkit_us"] / r["eager_us"])  # one round: the ratio of the two
    assert doc["runs"]["b"][0]["normkit_file"].startswith(str(copy))
    assert doc["runs"]["a"][0]["normkit_file"].startswith(str(REPO))
    assert (out / "host_ab.md").read_text().count("\n") == 2 + 2 * len(host_ab.CASES)


@pytest.mark.slow
def test_host_ab_same_process_imports_every_tree_renamed(tmp_path):
    """benchmarks/host_ab.py --same-process --rope: each tree's packages load under their own names in
    one process (the renamed copy's files, its own torch.library namespace, rms_norm_rope's custom ops
    included), a row per case and tree, the first tree's ratio to itself exactly 1."""
    from benchmarks import host_ab

    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "host_ab.py"), "--dry-run", "--same-process", "--rope",
           "--tree", f"a={REPO}", "--tree", f"b={REPO}", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "host_ab.json").read_text())
    assert doc["mode"] == "same-process"
    assert {(r["op"], r["call"], r["tree"]) for r in doc["rows"]} == {
        (op, kind, t) for op, kind in host_ab.CASES + host_ab.ROPE_CASES for t in ("a", "b")}
    for r in doc["rows"]:
        assert r["normkit_us"] > 0 and r["eager_us"] > 0
        assert r["vs_first"] == 1.0 if r["tree"] == "a" else r["vs_first"] > 0
    files = doc["runs"]["files"]
    assert files["a"].endswith("tf_0/__init__.py") and files["b"].endswith("tf_1/__init__.py")


def test_renamed_copy_leaves_no_reference_to_the_original_packages(tmp_path):
    """The renamed copy imports nothing of ``normkit`` / ``torch_frontend`` (those would be the other
    tree's) and registers its torch.library ops under its own namespace."""
    import re

    from benchmarks.host_ab import renamed_copy

    nk, tf = renamed_copy(REPO, tmp_path, 7)
    assert (nk, tf) == ("nk_7", "tf_7")
    for f in list((tmp_path / nk).rglob("*.py")) + list((tmp_path / tf).rglob("*.py")):
        text = f.read_text()
        assert not re.search(r"\b(from|import) (normkit|torch_frontend)\b", text), f
        assert '"normkit::' not in text and 'files("normkit")' not in text, f
    assert '"nk_7::norm_fwd"' in (tmp_path / tf / "_library_ops.py").read_text()


# ---------------------------------------------------------------------------------------------
# The LoRA training-step benchmarks' dry runs: benchmarks/lora_step.py (Torch, in a subprocess) and
# benchmarks/nnx_lora_step.py (Flax NNX, in process).


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_lora_step_runs_an_independent_copy_of_a_variant_as_its_control(tmp_path):
    import json

    out = run_script("benchmarks/lora_step.py", "--dry-run", "--variants", "normkit,hf,hf#2", "--rounds", "2",
                     "--steps", "2", "--no-profile", "--out", str(tmp_path))
    rows = {r["variant"]: r for r in json.loads((tmp_path / "lora_step.json").read_text())["rows"]}
    assert list(rows) == ["hf", "hf#2", "normkit"], out  # hf first: the reference
    assert all(r["status"] == "ok" and r["checks_ok"] for r in rows.values()), rows
    assert rows["hf#2"]["prepare"] == rows["hf"]["prepare"] and rows["hf#2"]["loss_first"] == rows["hf"]["loss_first"]
    assert len(rows["hf#2"]["round_medians_ms"]) == 2
    assert "`hf#2`: an independent copy of `hf`" in (tmp_path / "lora_step.md").read_text()
    # the second round starts one variant later than the first
    rounds = re.findall(r"eager round \d/2: (.*)", out)
    assert [[part.split()[0] for part in line.split(", ")] for line in rounds] == [
        ["hf", "hf#2", "normkit"], ["hf#2", "normkit", "hf"]], out
    with pytest.raises(AssertionError, match="unknown variant"):
        run_script("benchmarks/lora_step.py", "--dry-run", "--variants", "hf,hf", "--out", str(tmp_path))


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_lora_step_fails_when_its_budget_skips_every_row(tmp_path):
    """A budget below a mode's estimate skips all of its rows before any runs: with nothing measured
    the run fails (exit 2) and says so; a table of skipped rows alone is not a result."""
    out = run_script("benchmarks/lora_step.py", "--dry-run", "--variants", "hf,normkit", "--budget-s", "0.001",
                     "--out", str(tmp_path), returncode=2)
    assert "NOTHING RAN: skipped: budget" in out, out[-3000:]
    rows = json.loads((tmp_path / "lora_step.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["hf", "normkit"]
    assert all(r["status"].startswith("skipped: budget") for r in rows), rows


def test_lora_step_norm_share_by_name_counts_only_kernels_that_ran():
    """A step with the variant's kernels splits their time into forward and backward; a step with none
    (normkit compiled: Inductor generates its frozen norms) is unattributed, not a 0 ms share."""
    from types import SimpleNamespace

    from benchmarks import lora_step

    def kernel(name, us):
        return SimpleNamespace(name=name, device_type=lora_step.DeviceType.CUDA,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))
    ran = [kernel("norm_fwd_kernel", 3.0), kernel("norm_bwd_kernel", 5.0), kernel("norm_bwd_kernel", 7.0),
           kernel("triton_per_fused_add_mul_reciprocal_sqrt_sum_1", 11.0)]
    fwd, bwd, kernels = lora_step.norm_by_name(ran, "normkit")
    assert (fwd, bwd) == (3.0, 12.0) and kernels == {"norm_fwd_kernel": [1, 3.0], "norm_bwd_kernel": [2, 12.0]}
    assert lora_step.norm_by_name(ran[3:], "normkit") is None
    assert lora_step.norm_by_name(ran, "hf") is None


def test_lora_step_normkit_convert_turns_the_kernel_copy_off_while_its_step_runs():
    """``normkit_convert``'s forward runs with ``torch_frontend.functional._KERNEL_COPIES`` empty (each
    shared copy converted by ``y.to``), restored afterwards, after a raise too."""
    from benchmarks import lora_step
    from torch_frontend import functional

    kernel_copies, seen = functional._KERNEL_COPIES, []
    assert kernel_copies  # bf16 -> float32 among them: what the control turns off
    wrapped = lora_step._converting(lambda *a, **k: seen.append((functional._KERNEL_COPIES, a, k)) or "out")
    assert wrapped(1, b=2) == "out" and seen == [(frozenset(), (1,), {"b": 2})]
    assert functional._KERNEL_COPIES is kernel_copies

    def fails():
        raise RuntimeError("step failed")
    with pytest.raises(RuntimeError, match="step failed"):
        lora_step._converting(fails)()
    assert functional._KERNEL_COPIES is kernel_copies


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_lora_step_normkit_convert_dry_run(tmp_path):
    """A bf16 model under PEFT's default fp32 adapters: ``normkit_convert`` shares the copy as ``normkit``
    does, converted, with HF's first loss and LoRA gradients."""
    import json

    run_script("benchmarks/lora_step.py", "--dry-run", "--dtype", "bf16", "--variants", "hf,normkit,normkit_convert",
               "--no-profile", "--out", str(tmp_path))
    rows = {r["variant"]: r for r in json.loads((tmp_path / "lora_step.json").read_text())["rows"]}
    for name in ("hf", "normkit", "normkit_convert"):
        assert rows[name]["status"] == "ok" and rows[name]["checks_ok"], rows[name].get("check_notes")
    assert rows["normkit_convert"]["prepare"]["shares"] == rows["normkit"]["prepare"]["shares"] == 2
    assert "converted by y.to" in rows["normkit_convert"]["prepare"]["how"]


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
@pytest.mark.parametrize("arch, norms_per_layer, title", [("qwen3", 4, "Qwen3"), ("gemma3", 6, "Gemma 3")])
def test_lora_step_qk_norm_models_with_the_fused_qk_norm_rope(tmp_path, arch, norms_per_layer, title):
    """--arch qwen3 --mask, --arch gemma3: the fused QK-norm + RoPE variant patches every norm, fuses every
    attention, and matches HF's first loss and LoRA gradients (tiny fp32 model, Triton's interpreter)."""
    import json

    run_script("benchmarks/lora_step.py", "--dry-run", "--arch", arch, "--kv-heads", "2", "--mask",
               "--variants", "hf,normkit,normkit_rope", "--no-profile", "--out", str(tmp_path))
    result = json.loads((tmp_path / "lora_step.json").read_text())
    assert result["config"]["arch"] == arch and result["config"]["mask"]
    rows = {r["variant"]: r for r in result["rows"]}
    for name in ("hf", "normkit", "normkit_rope"):
        assert rows[name]["status"] == "ok" and rows[name]["checks_ok"], rows[name].get("check_notes")
    assert rows["normkit"]["prepare"]["qk_fused"] == 0 and rows["normkit_rope"]["prepare"]["qk_fused"] == 2
    # q, k, and the layer's own norms (Qwen3: input, post-attention; Gemma 3: also pre- and post-feedforward);
    # the final norm
    assert rows["normkit_rope"]["prepare"]["patched"] == 2 * norms_per_layer + 1
    assert f"{title} (random init)" in (tmp_path / "lora_step.md").read_text()


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_rope_bench_dry_run(tmp_path):
    """benchmarks/rope_bench.py --dry-run: every implementation that runs on a CPU is checked against HF's
    out and dx and timed; Liger (GPU only) is recorded with its reason; the byte model is the op's."""
    import json

    run_script("benchmarks/rope_bench.py", "--dry-run", "--out", str(tmp_path))
    result = json.loads((tmp_path / "rope_bench.json").read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"hf_eager", "torch_compile", "liger", "normkit_norm", "normkit", "copy"}
    assert rows["liger"]["status"].startswith("unavailable: ")
    for name in ("normkit_norm", "normkit"):
        assert rows[name]["status"] == "ok"
        for k, diff in rows[name]["max_abs_diff_vs_hf"].items():  # bf16: a couple of roundings of the largest value
            assert diff <= 0.02 * rows[name]["ref_max_abs"][k], (name, k, diff)
    c, bm = result["config"], result["byte_model"]
    assert bm["x_bytes"] == c["batch"] * c["seq"] * (c["heads"] + c["kv_heads"]) * c["head_dim"] * 2
    assert bm["bytes"] == 5 * bm["x_bytes"] + 4 * bm["table_bytes"]
    for r in rows.values():  # the GPU's own time: none without a GPU
        if r["status"] == "ok":
            assert (r["device_us"] is None) if c["dry_run"] else (r["device_us"] > 0), r
    assert "| normkit " in (tmp_path / "rope_bench.md").read_text()


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_lora_step_dry_run(tmp_path):
    import json

    out = run_script("benchmarks/lora_step.py", "--dry-run", "--out", str(tmp_path))
    assert re.search(r"^\|\s*variant\s*\|\s*mode\s*\|\s*status\s*\|\s*median ms", out, re.M), out
    result = json.loads((tmp_path / "lora_step.json").read_text())
    assert [row[1] for row in table_rows((tmp_path / "lora_step.md").read_text())] == ["eager"] * 4
    assert result["complete"] and result["config"]["dry_run"] and result["config"]["modes"] == ["eager"]
    rows = {(r["variant"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("hf", "eager"), ("normkit", "eager"), ("normkit_fused", "eager"), ("liger", "eager")}, \
        rows.keys()
    # Liger's kernels need a GPU: recorded with its reason, not dropped
    assert rows["liger", "eager"]["status"].startswith("unavailable: "), rows["liger", "eager"]["status"]
    hf, nk, fused = rows["hf", "eager"], rows["normkit", "eager"], rows["normkit_fused", "eager"]
    for row in (hf, nk, fused):
        assert row["status"] == "ok" and row["checks_ok"], (row["status"], row.get("check_notes"))
        assert row["norm_weights_frozen"] and row["norm_weights_with_grad"] == []
        assert row["step_ms"]["min"] <= row["step_ms"]["median"] <= row["step_ms"]["max"]
        assert row["loss_diff_vs_hf"] <= row["loss_tol"] and row["grad_rel_diff_vs_hf"] <= row["grad_tol"]
        assert row["lora_grad_norm_first"] > 0
    assert nk["norm_modules"] == {"HFRMSNorm": 2 * 2 + 1} and hf["norm_modules"] == {"LlamaRMSNorm": 5}
    assert nk["prepare"]["patched"] == 5 and "patched   5 x LlamaRMSNorm -> HFRMSNorm" in nk["prepare"]["patch_report"]
    assert nk["prepare"]["fused"] == 0 and fused["prepare"]["fused"] == 2, fused["prepare"]
    assert "fused   2 x LlamaDecoderLayer" in fused["prepare"]["patch_report"]
    # the forward ranges of the 5 norms, and the autograd nodes they made: none for layer 0's input
    # norm (its input comes from the frozen embedding), one node of the op's autograd Function for each of the others
    assert nk["profiled_steps"] == 3  # per-step figures: the ranges and nodes of three steps, divided
    assert nk["norm_by_module"]["forward_ranges"] == 5 and nk["norm_by_module"]["backward_nodes"] == 4
    assert hf["norm_by_module"]["forward_ranges"] == 5 and hf["norm_by_module"]["backward_nodes"] > 4
    assert 0 < nk["norm_pct"] <= 100


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_benchmark_smoke_run(tmp_path):
    """benchmarks/nnx_lora_step.py --smoke: the JSON and Markdown, every row ok and checked."""
    pytest.importorskip("flax")  # jax_frontend.nnx and its model
    jax = pytest.importorskip("jax")
    pytest.importorskip("pandas")  # its Markdown table (not in the [jax] install)
    from benchmarks import nnx_lora_step

    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW mixes its int32 step count with Python floats
        assert nnx_lora_step.main(["--smoke", "--variants", "flax,normkit", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "nnx_lora_step_smoke.json").read_text())
    assert doc["schema"] == nnx_lora_step.SCHEMA
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"flax", "normkit"} and all(r["status"] == "ok" and r["checks_ok"] for r in rows.values())
    assert rows["normkit"]["launches"]["backward_launches"] > 0 and rows["normkit"]["launches"]["with_compute_dw"] == 0
    assert rows["normkit"]["step_ms"]["n"] == 2 and rows["flax"]["memory_bytes"]["argument"] > 0
    md = (tmp_path / "nnx_lora_step_smoke.md").read_text()
    assert "| normkit" in md and "| flax" in md


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_nnx_qwen3_smoke_run_with_the_fused_qk_norm_rope(tmp_path):
    """benchmarks/nnx_lora_step.py --smoke --arch qwen3: flax, normkit and normkit_rope (the QK-norm and the
    rotary embedding as one rms_norm_rope) all ok and checked against flax; normkit_rope's backward keeps
    no q or k beyond what attention keeps, normkit's does (each QK-norm's output)."""
    pytest.importorskip("flax")
    jax = pytest.importorskip("jax")
    pytest.importorskip("pandas")
    from benchmarks import nnx_lora_step

    argv = ["--smoke", "--arch", "qwen3", "--variants", "flax,normkit,normkit_rope", "--out", str(tmp_path)]
    with jax.numpy_dtype_promotion("standard"):
        assert nnx_lora_step.main(argv) == 0
    doc = json.loads((tmp_path / "nnx_lora_step_qwen3_smoke.json").read_text())
    assert doc["config"]["arch"] == "qwen3" and doc["config"]["kv_heads"] < doc["config"]["heads"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"flax", "normkit", "normkit_rope"}
    assert all(r["status"] == "ok" and r["checks_ok"] for r in rows.values()), rows
    assert rows["normkit_rope"]["launches"]["rope_launches"] > 0 and rows["normkit"]["launches"]["rope_launches"] == 0
    assert rows["normkit_rope"]["launches"]["with_compute_dw"] == 0
    kept = {name: r["qk_residuals"] for name, r in rows.items()}
    assert len({k["attention_keeps"] for k in kept.values()}) == 1, kept
    assert kept["normkit_rope"]["beyond_attention"] == 0, kept
    # 1 layer: normkit keeps its q_norm's and k_norm's outputs (frozen scales: save="auto"), flax's XLA more
    assert kept["normkit"]["beyond_attention"] == 2 < kept["flax"]["beyond_attention"], kept
    assert "| normkit_rope" in (tmp_path / "nnx_lora_step_qwen3_smoke.md").read_text()


@pytest.mark.parametrize("N", [256, 2048, 3000, 8192])
def test_save_ab_sweep_tiles_plan_as_named(monkeypatch, N):
    """Each tile ``save_ab.py --sweep`` tries is planned as it says when set in ``launch._BWD_TILES``:
    warps, chunks, persistence, rows per tile (``m<rows>``: several rows per tile, from 2048 columns) and
    the parameters loaded per tile (``_t``)."""
    from benchmarks.save_ab import sweep_configs
    from normkit import launch
    from normkit.ops import GRADS, OPS, Options

    configs = sweep_configs(N)
    planned_m, block_n, _ = launch.tile_config(1, N)
    assert any(tile[4] for tile in configs.values()) == (block_n >= 2048), configs
    M = 1 << 17  # more tiles than any persistent grid has programs
    try:
        for name, tile in configs.items():
            monkeypatch.setattr(launch, "_BWD_TILES", {("layer_norm", True, 2, block_n): tile})
            launch.plan_backward.cache_clear()
            call, _ = launch.plan_backward(OPS["layer_norm"], M, N, "bfloat16", "bfloat16", None, False,
                                           Options(1e-5), GRADS[(True, False, False)], (N, 1, N, 1, 0, 1, 1, 1), 132,
                                           True, True, True)
            num_warps, chunk, per_sm, _, rows, per_tile = tile
            c = call.constexprs
            block_m = rows or planned_m
            tiles = -(-M // block_m)
            assert (call.num_warps, c["CHUNK_N"], c["PERSISTENT"], c["BLOCK_M"], c["PARAMS_PER_TILE"]) == (
                num_warps, chunk, bool(per_sm), block_m, bool(per_tile)), name
            assert call.grid == (min(tiles, round(per_sm * 132)) if per_sm else tiles,), name
            assert name.startswith(f"m{rows}_") == bool(rows), name
            assert name.endswith("_t") == bool(per_tile) and not (per_tile and chunk), name
    finally:  # no plan of a forced tile outlives the test
        launch.plan_backward.cache_clear()


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_save_ab_dry_run(tmp_path):
    """benchmarks/save_ab.py on the CPU: every cell of the (dry) table has both backwards, both forwards,
    both saves through autograd and the JAX row; the trip check and the launch A/B ran; then --sweep."""
    out = tmp_path / "save_ab.json"
    run_script("benchmarks/save_ab.py", "--dry-run", "--host-ab", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["schema"] == "normkit-save-ab/1" and len(doc["cells"]) == 3
    for cell in doc["cells"]:
        t = cell["torch"]
        for part in ("kernel_bwd", "kernel_fwd"):
            assert t[part]["input"] > 0 and t[part]["output"] > 0
        assert t["e2e_bwd"]["input"] > 0 and t["e2e_bwd"]["auto"] > 0
        assert cell["jax"]["auto"] > 0 and cell["jax"]["xla"] > 0
    assert doc["trip"] == {"poisoned_all_nan": True, "next_call_equals_input": True}
    assert set(doc["host_ab"]["us_per_call"]) == {"triton", "direct"}
    assert (tmp_path / "save_ab.md").read_text().count("\n| ") >= 4
    sweep = tmp_path / "sweep.json"
    run_script("benchmarks/save_ab.py", "--dry-run", "--sweep", "--ops", "rms_norm", "--out", str(sweep))
    (cell,) = json.loads(sweep.read_text())["cells"]
    from benchmarks.save_ab import sweep_configs

    assert set(cell["sweep"]) == {"input", "planned", *sweep_configs(256)}
    assert all(v > 0 for v in cell["sweep"].values()), cell


def test_save_ab_only_picks_the_named_cells():
    """save_ab.py --only: the cells named op:dtype:MxN, in the table's order; a cell not in the table
    stops the run, naming it."""
    from benchmarks.save_ab import _cells

    got = _cells(["rms_norm", "layer_norm"], False, ("layer_norm:fp32:8192x8192", "rms_norm:bf16:262144x128"))
    assert got == [("rms_norm", "bf16", (262144, 128)), ("layer_norm", "fp32", (8192, 8192))]
    assert len(_cells(["rms_norm"], False)) == 10
    with pytest.raises(SystemExit, match="layer_norm:bf16:262144x128"):
        _cells(["rms_norm", "layer_norm"], False, ("layer_norm:bf16:262144x128",))


def test_registers_reports_each_backward_compiled_for_sm90():
    """benchmarks/registers.py: one row per backward (from x, from y), registers of a compiled sm_90
    kernel and the programs per SM they allow."""
    out = run_script("benchmarks/registers.py", "--ops", "rms_norm", "--dtypes", "bfloat16", "--n", "256")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| rms_norm")]
    assert [r[3].strip() for r in rows] == ["from x", "from y"], out
    for r in rows:
        regs, stack, per_sm = int(r[9]), int(r[10]), int(r[12])
        assert 0 < regs <= 255 and stack == 0 and per_sm == min(65536 // (32 * int(r[4]) * regs), 2048 // (32 * int(r[4])))


def test_registers_names_an_unknown_dtype(capsys):
    """benchmarks/registers.py --dtypes takes the benchmarks' names (bf16, fp32, fp16) or the full ones;
    another name is a usage error that names it, before anything is compiled."""
    from benchmarks import registers

    with pytest.raises(SystemExit):
        registers.main(["--dtypes", "bf16,xx", "--n", "256"])
    assert "--dtypes: unknown xx; expected bf16, fp32, fp16" in capsys.readouterr().err
