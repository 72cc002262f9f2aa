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

ROOT = Path(__file__).resolve().parent.parent


def run_script(*argv: str, returncode: int = 0) -> str:
    """The script's standard output, once it has exited with ``returncode``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry runs check the CPU path, also where a GPU exists
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == returncode, \
        f"{argv} exited {proc.returncode}, not {returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow  # a tool's end-to-end dry run: the slow tier
def test_tune_dry_run():
    out = run_script("scripts/tune.py", "--dry-run", "--shapes", "72x48")
    for op in OPS:
        for mode in ("fwd", "bwd_frozen", "bwd_full"):
            m = re.search(rf"^{op}\s+{mode}\s+bfloat16\s+72x48: (\d+)/(\d+) variants launched, "
                          r"all within tolerance of the base plan$", out, re.M)
            assert m, f"no dry-run row for {op} {mode}:\n{out}"
            assert m[1] == m[2] and int(m[1]) > 1, m[0]  # every variant ran, and there were several


def test_compare():
    out = run_script("scripts/compare.py", "--shape", "8x64", "--reps", "1")
    header = re.search(r"^op\s+frontend\s+backward\s+kept\s+kernels\s+partials \(B\)\s+dx err\s+dW err\s+"
                       r"dx frozen==full\s+fwd\+bwd us$", out, re.M)
    assert header, out
    for column in re.split(r"\s{2,}", header[0]):  # every column is explained under the table
        assert re.search(rf"^  {re.escape(column)}: \S", out, re.M), f"no legend line for {column!r}:\n{out}"
    for op in OPS.values():
        for frontend in ("torch", "jax"):
            full = re.search(rf"^{op.name}\s+{frontend}\s+full\s+x\s+norm_fwd,norm_bwd,partial_sum\s+(\d+)\s", out,
                             re.M)
            frozen = re.search(rf"^{op.name}\s+{frontend}\s+frozen\s+x\s+norm_fwd,norm_bwd\s+0\s+\S+\s+-\s+yes\s", out,
                               re.M)
            # save="auto": the output kept where the weight allows (dx then not bitwise the full one's)
            auto = re.search(rf"^{op.name}\s+{frontend}\s+frozen, auto\s+([xy])\s+norm_fwd,norm_bwd\s+0\s+\S+\s+-\s+"
                             rf"(yes|no)\s", out, re.M)
            assert full and frozen and auto, f"rows missing for {op.name} {frontend}:\n{out}"
            assert (auto[1], auto[2]) in (("x", "yes"), ("y", "no")), auto[0]
            if not op.params == ("weight", "bias"):  # RMSNorm's weights there are safe: y is kept
                assert auto[1] == "y", auto[0]
            # one fp32 partial row of N per program, for dW (and dB)
            assert int(full[1]) > 0 and int(full[1]) % (4 * 64 * len(op.params)) == 0, full[0]
    assert "Checks passed" in out


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
                         op.grads(op.inputs), (N, 1, N, 1, 0, 1, 1, 1), INTERPRETER_NUM_SMS)


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
    path, measured_path = tmp_path / "tiles.json", tmp_path / "tiles_measured.json"
    path.write_text(tune.TILES.read_text())
    measured_path.write_text(tune.TILES_MEASURED.read_text())
    table = tune.write_tiles(path, measured_path, {key: won, (False, 4, 8192): tie}, "Some GPU", "abc1234",
                             "2031-01-02")
    assert json.loads(path.read_text()) == table
    record = json.loads(measured_path.read_text())
    got = rms_forward_tiles(table)
    assert got[key] == (1, 8, 0) and (False, 4, 8192) not in got  # 1% faster: tile_config's tile is kept
    assert {k: v for k, v in got.items() if k != key} == {
        k: v for k, v in rms_forward_tiles(shipped).items() if k not in (key, (False, 4, 8192))}
    assert [{k: v for k, v in e.items() if k != "measured"} for e in record["rms_forward"]] == table["rms_forward"]
    assert record["backward_dx"] == json.loads(tune.TILES_MEASURED.read_text())["backward_dx"]  # kept as it was
    (entry,) = [e for e in record["rms_forward"] if (e["residual"], e["elem_bytes"], e["block_n"]) == key]
    assert "measured" not in json.dumps(table["rms_forward"])
    assert entry["measured"] == {"shape": "65536x2048", "dtype": "bfloat16", "us": 100.0, "baseline": [2, 4, 0],
                                 "baseline_us": 110.0, "device": "Some GPU", "date": "2031-01-02", "commit": "abc1234"}


def test_shipped_tiles_name_their_measurement():
    """Every shipped tile has its measurement in the record beside the benchmarks (none in the
    library): the same key and tile, a device, date and commit, and a time below the tile it replaced."""
    table = json.loads((ROOT / "normkit" / "tiles.json").read_text())
    record = json.loads((ROOT / "benchmarks" / "results" / "tiles_measured.json").read_text())
    assert table["rms_forward"] and table["backward_dx"]
    for name in ("rms_forward", "backward_dx"):
        assert [{k: v for k, v in e.items() if k != "measured"} for e in record[name]] == table[name], name
        for e in record[name]:
            m = e["measured"]
            assert m["device"] and m["commit"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["date"]), e
            assert 0 < m["us"] < m["baseline_us"] and m["baseline"] != e["tile"], e
    for e in table["rms_forward"]:
        block_m, warps, chunk = e["tile"]
        assert chunk == 0 or (e["block_n"] % chunk == 0 and 16 <= chunk < e["block_n"]), e
