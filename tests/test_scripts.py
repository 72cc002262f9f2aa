"""Smoke tests of the scripts, each in a subprocess at a tiny CPU shape (Triton's interpreter): they
exit 0 and print the rows they should. Plus the sweep's guards against malformed variants."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from normkit.ops import OPS
from tests.test_bench import table_rows

ROOT = Path(__file__).resolve().parent.parent


def run_script(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry runs check the CPU path, also where a GPU exists
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_tune_dry_run():
    out = run_script("scripts/tune.py", "--dry-run", "--shapes", "72x48")
    for op in OPS:
        for mode in ("fwd", "bwd_frozen", "bwd_full"):
            m = re.search(rf"^{op}\s+{mode}\s+bfloat16\s+72x48: (\d+)/(\d+) variants launched, "
                          r"all within tolerance of the reference$", out, re.M)
            assert m, f"no dry-run row for {op} {mode}:\n{out}"
            assert m[1] == m[2] and int(m[1]) > 1, m[0]  # every variant ran, and there were several


def test_tune_pallas_dry_run():
    out = run_script("scripts/tune_pallas.py", "--dry-run", "--ops", "layer_norm")
    for mode in ("fwd", "bwd_full", "bwd_frozen"):
        m = re.search(rf"^layer_norm {mode} bfloat16 24x256: (\d+)/(\d+) variants launched as configured, "
                      r"all within tolerance of the base$", out, re.M)
        assert m, f"no dry-run row for {mode}:\n{out}"
        assert m[1] == m[2] and int(m[1]) > 1, m[0]


def test_compare():
    out = run_script("scripts/compare.py", "--shape", "8x64", "--reps", "1")
    header = re.search(r"^op\s+frontend\s+backward\s+kernels\s+partials \(B\)\s+dx err\s+dW err\s+"
                       r"dx frozen==full\s+fwd\+bwd us$", out, re.M)
    assert header, out
    for column in re.split(r"\s{2,}", header[0]):  # every column is explained under the table
        assert re.search(rf"^  {re.escape(column)}: \S", out, re.M), f"no legend line for {column!r}:\n{out}"
    for op in OPS.values():
        for frontend in ("torch", "jax"):
            full = re.search(rf"^{op.name}\s+{frontend}\s+full\s+norm_fwd,norm_bwd,partial_sum\s+(\d+)\s", out, re.M)
            frozen = re.search(rf"^{op.name}\s+{frontend}\s+frozen\s+norm_fwd,norm_bwd\s+0\s+\S+\s+-\s+yes\s", out,
                               re.M)
            assert full and frozen, f"rows missing for {op.name} {frontend}:\n{out}"
            # one fp32 partial row of N per program, for dW (and dB)
            assert int(full[1]) > 0 and int(full[1]) % (4 * 64 * len(op.params)) == 0, full[0]
    assert "Checks passed" in out


def test_host_time(tmp_path):
    import json

    records = tmp_path / "host_time.jsonl"
    out = run_script("benchmarks/host_time.py", "--shape", "8x64", "--rep-ms", "20", "--ops", "fused_add_rms_norm",
                     "--json", str(records))
    for mode in ("fwd", "fwd_bwd_frozen", "fwd_bwd_full"):
        assert re.search(rf"^\s+fused_add_rms_norm\s+{mode}\s+python_floor\s+[\d.]+ \| normkit\s+[\d.]+ \| "
                         r"torch_eager\s+[\d.]+", out, re.M), out
    got = [json.loads(line) for line in records.read_text().splitlines()]
    assert sorted((r["mode"], r["impl"]) for r in got) == sorted(
        (m, i) for m in ("fwd", "fwd_bwd_frozen", "fwd_bwd_full") for i in ("python_floor", "normkit", "torch_eager"))
    assert all(r["host_us"] > 0 and r["shape"] == "8x64" for r in got), got


def test_device_time_dry_run(tmp_path):
    import json

    out = run_script("benchmarks/device_time.py", "--dry-run", "--ops", "rms_norm", "--impls", "pallas,xla",
                     "--out", str(tmp_path / "device_time.json"))
    assert "DRY RUN" in out and "say nothing about speed" in out, out
    for mode in ("fwd", "bwd_full", "bwd_frozen"):
        for impl in ("pallas", "xla"):
            assert re.search(rf"^rms_norm\s+{mode}\s+bf16\s+24x256\s+{impl}(\s+[\d.]+){{4}}\s", out, re.M), \
                f"no row for {mode} {impl}:\n{out}"
    result = json.loads((tmp_path / "device_time.json").read_text())
    assert result["dry_run"] and result["event_source"] == "host" and result["copy"]["tbps"] > 0
    assert result["versions"]["jax"] and result["device"]
    recs = result["records"]
    assert sorted((r["mode"], r["impl"]) for r in recs) == sorted(
        (m, i) for m in ("fwd", "bwd_full", "bwd_frozen") for i in ("pallas", "xla")), recs
    for r in recs:
        assert r["error"] is None, r["error"]
        assert r["device_busy_us"] > 0 and r["events_per_call"] > 0 and r["wall_us"] > 0, r
        assert r["kernels"] and all(k["median_us"] >= 0 and k["per_call"] > 0 for k in r["kernels"]), r["kernels"]
        assert r["pct_copy_device"] > 0 and r["bytes"] > 0 and r["bench_impl"].startswith("normkit_jax_")


def test_device_time_aggregation():
    """The GPU rule on synthetic events: two stream lines count, the derived "XLA Ops" line (and the
    host plane) do not; every expected value would change if they were counted."""
    from benchmarks.device_time import Event, is_stream_line, select_events, summarize

    def ev(name, start, dur, hlo_op=None):
        return Event(name, start, dur, {} if hlo_op is None else {"hlo_op": hlo_op, "correlation_id": 7})

    planes = {
        "/host:CPU": {"python": [ev("fusion.1", 5000, 900, "fusion.1")]},
        "/device:GPU:0": {
            "Stream #13(Kernel,MemsetD)": [ev("k_a", 0, 100, "fusion.1"), ev("memset", 100, 10),
                                           ev("k_a", 1000, 120, "fusion.1"), ev("memset", 1120, 20)],
            "Stream #14(Kernel)": [ev("k_b", 50, 100, "custom-call.3"), ev("k_b", 1100, 170, "custom-call.3")],
            "XLA Ops": [ev("fusion.1", -500, 3000, "fusion.1"), ev("custom-call.3", 1100, 170, "custom-call.3")],
        },
    }
    assert is_stream_line("Stream #13(Kernel,MemcpyD2D)") and not is_stream_line("XLA Ops")
    assert not is_stream_line("CUPTI overhead") and not is_stream_line("Steps")
    events, listing = select_events(planes, "gpu")
    assert {(ln["plane"], ln["line"]): ln["kept"] for ln in listing} == {
        ("/host:CPU", None): 0, ("/device:GPU:0", "Stream #13(Kernel,MemsetD)"): 4,
        ("/device:GPU:0", "Stream #14(Kernel)"): 2, ("/device:GPU:0", "XLA Ops"): 0}
    s = summarize(events, calls=2)
    assert s["events_per_call"] == 3.0                                      # 6 events / 2 calls
    assert s["device_busy_us"] == pytest.approx((100 + 10 + 120 + 20 + 100 + 170) / 2 / 1e3)
    assert s["device_span_us"] == pytest.approx((1270 - 0) / 2 / 1e3)      # k_b ends last, at 1100 + 170
    assert s["device_union_us"] == pytest.approx((150 + 270) / 2 / 1e3)    # [0, 150] and [1000, 1270]
    kernels = {(k["name"], k["hlo_op"]): k for k in s["kernels"]}
    assert list(kernels) == [("k_b", "custom-call.3"), ("k_a", "fusion.1"), ("memset", None)]  # by total time
    assert [(k["median_us"], k["per_call"]) for k in kernels.values()] == [
        pytest.approx((0.135, 1.0)), pytest.approx((0.110, 1.0)), pytest.approx((0.015, 1.0))]
    # the CPU rule: only /host:CPU's events with an hlo_op stat
    events, _ = select_events(planes, "host")
    assert [e.name for e in events] == ["fusion.1"] and summarize(events, 1)["device_busy_us"] == pytest.approx(0.9)
    assert summarize([], 2)["events_per_call"] == 0.0


def test_device_time_report_leaves_the_boundary_copy_out_of_the_kernel_share():
    """The report's target table: a Pallas row's kernel bandwidth leaves its memcpy events out
    (the fused op's jit-boundary copy), and a full backward is compared by wall time to each peer."""
    from benchmarks.device_time import is_memcpy, report

    assert is_memcpy("MemcpyD2D") and is_memcpy("memcpy128") and not is_memcpy("normkit_partial_sum")
    M, N = 8192, 8192
    nbytes = 4 * M * N * 2  # 537 MB
    copy_tbps = 4.0

    def rec(impl, mode, wall, busy, kernels):
        return {"op": "fused_add_rms_norm", "mode": mode, "dtype": "bf16", "shape": f"{M}x{N}", "M": M, "N": N,
                "impl": impl, "calls": 10, "bytes": nbytes, "error": None, "wall_us": wall, "device_busy_us": busy,
                "pct_copy_device": 100 * nbytes / (busy * 1e-6) / 1e12 / copy_tbps,
                "kernels": [{"name": n, "total_us": 10 * us} for n, us in kernels]}

    kernel_us = nbytes / (0.9 * copy_tbps * 1e12) * 1e6  # 90% of copy on its own
    run = {"device": "H", "versions": {}, "copy": {"tbps": copy_tbps}, "records": [
        rec("pallas", "bwd_frozen", kernel_us + 80, kernel_us + 60, [("k", kernel_us), ("MemcpyD2D", 60)]),
        rec("pallas", "bwd_full", 200.0, 190.0, [("k", 130.0), ("MemcpyD2D", 60)]),
        rec("xla", "bwd_full", 310.0, 300.0, [("f", 240.0), ("memcpy128", 60)]),
        rec("jnp", "bwd_full", 280.0, 270.0, [("f", 210.0), ("memcpy128", 60)])]}
    targets = table_rows(report([run]).split("## Pallas against its targets")[1])
    assert targets == [["fused_add_rms_norm", "bwd_frozen", "bf16 8192x8192", "90.0% of copy", "met (≥ 85%)"],
                       ["fused_add_rms_norm", "bwd_full", "bf16 8192x8192", "1.55× vs xla, 1.40× vs jnp",
                        "missed (≥ 1.5×)"]], targets
    run["records"] = run["records"][:2]  # no XLA rows: the full backward has nothing to be compared with
    targets = table_rows(report([run]).split("## Pallas against its targets")[1])
    assert [row[1] for row in targets] == ["bwd_frozen"], targets


# ---------------------------------------------------------------------------------------------
# The sweep's guards (scripts/tune.py, imported).


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("normkit_tune_script", ROOT / "scripts" / "tune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _full_backward_plan(M=40, N=48):
    from normkit.launch import INTERPRETER_NUM_SMS, plan_backward

    op = OPS["layer_norm"]
    return plan_backward(op, M, N, "float32", "float32", "float32", False, op.options(eps=1e-5),
                         op.grads(op.inputs), (N, 1, N, 1, 0, 1, 1), INTERPRETER_NUM_SMS)


def test_variants_never_pass_an_unknown_constexpr(tune):
    bwd, red = _full_backward_plan()
    tune.check_constexprs(bwd)
    tune.check_constexprs(red)
    # what the old sweep did: a flag the kernel no longer has (the interpreter would accept it)
    stale = dataclasses.replace(bwd, cache={})
    object.__setattr__(stale, "constexprs", dict(bwd.constexprs, WELFORD=True))
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['WELFORD'\]"):
        tune.check_constexprs(stale)
    with pytest.raises((ValueError, AssertionError)):  # KernelCall itself refuses it too
        dataclasses.replace(bwd, constexprs=dict(bwd.constexprs, WELFORD=True), cache={})


def test_variants_resize_partials_and_the_reduction(tune):
    bwd, red = _full_backward_plan()
    assert bwd.grid != (2,)
    v = tune.variant(bwd, block_m=4, num_warps=8, grid=2, stages=2)
    assert v.grid == (2,) and v.cache == {} and v.cache is not bwd.cache
    assert {name: shape for name, (shape, _) in v.out_specs.items() if name.endswith("_PART")} == {
        "DW_PART": (2, 48), "DB_PART": (2, 48)}
    tune.check_launches([v, tune.reduce_variant(red, 2)])
    with pytest.raises(ValueError, match="sums"):
        tune.check_launches([v, red])  # the base plan's reduction sums another number of rows


def test_tune_writes_the_tiles_it_measured(tune, tmp_path):
    """--write-tiles: a forward tile faster than tile_config's by more than ADOPT replaces its key's
    entry, with its measurement; one within ADOPT removes the entry; launch reads what was written."""
    from normkit.launch import INTERPRETER_NUM_SMS, plan_forward, rms_forward_tiles

    op = OPS["rms_norm"]
    call = plan_forward(op, 64, 2048, "bfloat16", "bfloat16", None, op.options(eps=1e-6), False,
                        (2048, 1, 0, 1, 1, 1), INTERPRETER_NUM_SMS)
    default = tune.default_config(call)
    assert (default.block_m, default.num_warps) == (2, 4)  # tile_config(1, 2048)
    results = [(110.0, default), (100.0, tune.Config(1, 8, 0, 0)), (104.0, tune.Config(1, 4, 0, 0, 1024)),
               (90.0, tune.Config(1, 4, 2, 2))]  # the last persistent: not a tile the forward runs
    key, won = tune.tile_choice(op, "bfloat16", 65536, 2048, call, results)
    assert key == (False, 2, 2048) and won["tile"] == [1, 8, 0] and won["baseline"] == [2, 4, 0], won
    _, tie = tune.tile_choice(op, "float32", 8192, 8192, call, [(100.0, default), (99.0, tune.Config(1, 8, 0, 0))])
    shipped = json.loads(tune.TILES.read_text())
    path = tmp_path / "tiles.json"
    path.write_text(tune.TILES.read_text())
    table = tune.write_tiles(path, {key: won, (False, 4, 8192): tie}, "Some GPU", "abc1234", "2031-01-02")
    assert json.loads(path.read_text()) == table
    got = rms_forward_tiles(table)
    assert got[key] == (1, 8, 0) and (False, 4, 8192) not in got  # 1% faster: tile_config's tile is kept
    assert {k: v for k, v in got.items() if k != key} == {
        k: v for k, v in rms_forward_tiles(shipped).items() if k not in (key, (False, 4, 8192))}
    (entry,) = [e for e in table["rms_forward"] if (e["residual"], e["elem_bytes"], e["block_n"]) == key]
    assert entry["measured"] == {"shape": "65536x2048", "dtype": "bfloat16", "us": 100.0, "baseline": [2, 4, 0],
                                 "baseline_us": 110.0, "device": "Some GPU", "date": "2031-01-02", "commit": "abc1234"}


def test_shipped_tiles_name_their_measurement():
    table = json.loads((ROOT / "normkit" / "tiles.json").read_text())
    assert table["rms_forward"]
    for e in table["rms_forward"]:
        block_m, warps, chunk = e["tile"]
        assert chunk == 0 or (e["block_n"] % chunk == 0 and 16 <= chunk < e["block_n"]), e
        m = e["measured"]
        assert m["device"] and m["commit"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["date"]), e
        assert 0 < m["us"] < m["baseline_us"] and m["baseline"] != e["tile"], e


def test_host_parts_times_every_piece():
    out = run_script("benchmarks/host_parts.py", "--shape", "8x64", "--dtype", "float32", "--calls", "2",
                     "--blocks", "1")
    rows = dict(re.findall(r"^  (\S.*?)\s+(\d+\.\d+)$", out, re.M))
    assert {"lookup (key + dict)", "bound forward (allocs + launch)", "bound backward dx (key + alloc + launch)",
            "fwd+grad: floor (allocate only)", "fwd+grad: floor + 4 saved tensors", "fwd+grad: normkit",
            "fwd+grad: F.rms_norm", "tf.rms_norm, inference", "F.rms_norm, inference"} <= rows.keys(), out
    assert all(float(us) > 0 for us in rows.values()), rows


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
    # norm (its input comes from the frozen embedding), one NormFunction node for each of the others
    assert nk["profiled_steps"] == 3  # per-step figures: the ranges and nodes of three steps, divided
    assert nk["norm_by_module"]["forward_ranges"] == 5 and nk["norm_by_module"]["backward_nodes"] == 4
    assert hf["norm_by_module"]["forward_ranges"] == 5 and hf["norm_by_module"]["backward_nodes"] > 4
    assert 0 < nk["norm_pct"] <= 100
