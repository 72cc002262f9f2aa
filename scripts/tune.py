"""Launch-configuration sweep: variants of normkit's real launch plans, timed on a CUDA GPU.

For each (op, mode, dtype, shape) the base plans are the ones ``normkit.driver`` makes (captured from its
launches through the Torch backend). Variants change only the launch: ``BLOCK_M`` around the plan's,
``num_warps`` 4/8/16, one program per tile or a persistent grid of 1-4 programs per SM (the full
backward's partial buffers and reduction follow its grid), ``LOOP_STAGES`` (prefetch depth), and for
the RMSNorm forwards ``CHUNK_N`` (the row read in two passes over half or quarter rows). Each variant is a
``dataclasses.replace`` of the plan's ``KernelCall`` whose constexprs are checked against the kernel's
``arg_names``. On CUDA every variant is timed (``do_bench``), checked against the base plan's results and
the best printed with its share of a copy's bandwidth; ``--dry-run`` (CPU, Triton's interpreter) launches
each variant once and checks it against the base plan.

``--write-tiles`` (CUDA, RMSNorm forwards): per key (residual, element bytes, BLOCK_N) the fastest
one-program-per-tile variant goes to ``normkit/tiles.json`` (and, with its time, ``tile_config``'s tile and
time as the baseline, the device, date and commit, to ``benchmarks/results/tiles_measured.json``), when it
beats that baseline by more than ``ADOPT``;
otherwise the key's entry is removed. Where several swept shapes share a key, the largest decides.

    python scripts/tune.py [--shapes 8192x8192,32768x4096] [--ops rms_norm,layer_norm] [--dtypes bfloat16]
    python scripts/tune.py --modes fwd --ops rms_norm,fused_add_rms_norm --write-tiles
    python scripts/tune.py --dry-run [--shapes 72x48] [--ops ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import bytemodel  # noqa: E402
from benchmarks.timing import Timer, tbps  # noqa: E402
from normkit import driver  # noqa: E402
from normkit.launch import KernelCall, tile_config  # noqa: E402
from normkit.ops import ELEM_BYTES, OPS, Grads, Op  # noqa: E402
from normkit.shapes import parse_list  # noqa: E402
from normkit.testing import TOLERANCES, poisoned_outputs  # noqa: E402
from torch_frontend import backend  # noqa: E402

MODES = tuple(m for m in bytemodel.MODES if m != "fwd_bwd")
DEFAULT_SHAPES = "8192x8192,32768x4096,65536x2048,4096x1024"
DRY_RUN_SHAPES = "72x48"  # 3-9 tiles, a ragged row: masks, persistent loops with prefetch, partials
WARPS = (4, 8, 16)
TILES = ROOT / "normkit" / "tiles.json"
TILES_MEASURED = ROOT / "benchmarks" / "results" / "tiles_measured.json"  # each tile's measurement
ADOPT = 0.02  # --write-tiles: a tile other than tile_config's must be this much faster


# ---------------------------------------------------------------------------------------------
# Variants of a plan.


def check_constexprs(call: KernelCall) -> None:
    """Every constexpr of ``call`` must be a parameter of its kernel, and the kernel's parameters must be
    bound exactly once, in order: Triton's interpreter silently accepts an unknown keyword."""
    names = tuple(call.kernel.arg_names)
    unknown = sorted(set(call.constexprs) - set(names))
    if unknown:
        raise ValueError(f"{call.name} has no parameter(s) {unknown}: a variant may only change the kernel's "
                         f"own constexprs")
    bound = call.inputs + call.scalar_names + call.outputs + tuple(call.constexprs)
    if bound != names:
        raise ValueError(f"{call.name}: arguments {bound} do not bind its parameters {names}")


def variant(call: KernelCall, *, block_m: int, num_warps: int, grid: int, stages: int, chunk: int = 0) -> KernelCall:
    """``call`` with another launch configuration; fp32 partial buffers get one row per program."""
    out_specs = {name: (((grid, shape[1]), dtype) if name.endswith("_PART") else (shape, dtype))
                 for name, (shape, dtype) in call.out_specs.items()}
    constexprs = dict(call.constexprs, BLOCK_M=block_m, LOOP_STAGES=stages)
    if "CHUNK_N" in constexprs:
        constexprs["CHUNK_N"] = chunk
    elif chunk:
        raise ValueError(f"{call.name} has no CHUNK_N")
    new = dataclasses.replace(call, grid=(grid,), num_warps=num_warps, out_specs=out_specs, cache={},
                              constexprs=constexprs)
    check_constexprs(new)
    return new


def reduce_variant(call: KernelCall, partial_rows: int) -> KernelCall:
    """The reduction ``call`` over ``partial_rows`` partial rows (its loop masks any BLOCK_G)."""
    scalars = tuple(partial_rows if name == "G" else value for name, value in zip(call.scalar_names, call.scalars))
    new = dataclasses.replace(call, scalars=scalars, cache={})
    check_constexprs(new)
    return new


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int
    num_warps: int
    per_sm: int  # 0: one program per tile; k: a persistent grid of k programs per SM
    stages: int
    chunk: int = 0  # CHUNK_N: 0 reads each row once; else two passes over chunks of this many columns

    def __str__(self) -> str:
        grid = "per-tile" if self.per_sm == 0 else f"{self.per_sm}/SM"
        return f"bm={self.block_m} w={self.num_warps} grid={grid} st={self.stages}" + (
            f" chunk={self.chunk}" if self.chunk else "")


def configs(call: KernelCall, mode: str) -> list[Config]:
    """The sweep around ``call``'s own configuration (as in docs/PERFORMANCE_RECORD.md)."""
    base_m, block_n = call.constexprs["BLOCK_M"], call.constexprs["BLOCK_N"]
    largest = max(1, 16384 // block_n)  # tiles of at most 16384 elements
    bms = sorted({max(1, base_m // 2), base_m, min(2 * base_m, largest)})
    out = []
    for bm in bms:
        for w in WARPS:
            if bm * block_n < 32 * w:  # fewer than one element per thread
                continue
            if mode == "bwd_full":  # the partials need a persistent grid
                out += [Config(bm, w, k, st) for k in (1, 2, 3) for st in (1, 2, 3, 4)]
            else:
                out.append(Config(bm, w, 0, 0 if mode == "fwd" else 1))  # the forward's tiles run loop-free
                if bm in bms[:2]:
                    out += [Config(bm, w, k, st) for k in (2, 4) for st in (2, 3)]
                if mode == "fwd" and call.constexprs["IS_RMS"] and bm in bms[:2]:  # two passes over chunks
                    out += [Config(bm, w, 0, 0, chunk) for chunk in (block_n // 4, block_n // 2)
                            if chunk >= 16 and bm * chunk >= 32 * w]
    return out


def base_config(call: KernelCall, num_sms: int) -> Config:
    M = dict(zip(call.scalar_names, call.scalars))["M"]
    bm = call.constexprs["BLOCK_M"]
    tiles = -(-M // bm)
    grid = call.grid[0]
    per_sm = 0 if grid == tiles and call.constexprs["LOOP_STAGES"] <= 1 else -(-grid // num_sms)
    return Config(bm, call.num_warps, per_sm, call.constexprs["LOOP_STAGES"], call.constexprs.get("CHUNK_N", 0))


def default_config(call: KernelCall) -> Config:
    """tile_config's tile for ``call``'s rows: one program per tile, the row read once."""
    block_m, _, num_warps = tile_config(1, call.constexprs["BLOCK_N"])
    return Config(block_m, num_warps, 0, 0)


def tile_choice(op: Op, dtype: str, M: int, N: int, call: KernelCall, results: list) -> tuple | None:
    """(key, measured entry) for tiles.json from one forward sweep's (us, Config) results, or None
    when tile_config's tile did not run. The candidates are the forward's grid: one program per tile."""
    default = default_config(call)
    timed = {cfg: us for us, cfg in results if cfg.per_sm == 0}
    if default not in timed:
        return None
    best = min(timed, key=timed.get)
    key = (op.has_residual, ELEM_BYTES[dtype], call.constexprs["BLOCK_N"])
    return key, {"tile": [best.block_m, best.num_warps, best.chunk], "M": M, "N": N, "dtype": dtype,
                 "us": round(timed[best], 1), "baseline": [default.block_m, default.num_warps, 0],
                 "baseline_us": round(timed[default], 1)}


def write_tiles(path: Path, measured_path: Path, choices: dict, device: str, commit: str, date: str) -> dict:
    """Update the tiles.json at ``path`` with ``choices`` ({key: tile_choice's entry}), and the record of
    their measurements at ``measured_path`` (the same entries, each with its "measured"); returns the
    table."""
    table, record = json.loads(path.read_text()), json.loads(measured_path.read_text())
    entries = {(e["residual"], e["elem_bytes"], e["block_n"]): e for e in record["rms_forward"]}
    for (residual, elem_bytes, block_n), c in choices.items():
        key = (residual, elem_bytes, block_n)
        if c["tile"] == c["baseline"] or c["us"] >= (1 - ADOPT) * c["baseline_us"]:
            entries.pop(key, None)
            continue
        measured = {"shape": f"{c['M']}x{c['N']}", "dtype": c["dtype"], "us": c["us"], "baseline": c["baseline"],
                    "baseline_us": c["baseline_us"], "device": device, "date": date, "commit": commit}
        entries[key] = {"residual": residual, "elem_bytes": elem_bytes, "block_n": block_n, "tile": c["tile"],
                        "measured": measured}
    record["rms_forward"] = [entries[k] for k in sorted(entries)]
    table["rms_forward"] = [{k: v for k, v in e.items() if k != "measured"} for e in record["rms_forward"]]
    path.write_text(tiles_text(table))
    measured_path.write_text(tiles_text(record))
    return table


def tiles_text(table: dict) -> str:
    """tiles.json's text: its "about", then each list of entries (the other tables, such as the
    backward's, kept as they were), one entry per line."""
    parts = [f'  "about": {json.dumps(table["about"])}']
    for name, entries in table.items():
        if name != "about":
            rows = ",\n".join("    " + json.dumps(e) for e in entries)
            parts.append(f'  "{name}": [\n{rows}\n  ]')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def build(plan: list, cfg: Config, M: int, num_sms: int) -> list | None:
    """The launches of ``plan`` (its ``KernelCall``s: a kernel, then the reduction of its partials, if
    any) under ``cfg``; None when that is the launch of a smaller configuration (nothing to prefetch)."""
    call, *rest = plan
    tiles = -(-M // cfg.block_m)
    grid = tiles if cfg.per_sm == 0 else min(tiles, cfg.per_sm * num_sms)
    if cfg.stages > 1 and grid >= tiles:  # one tile per program: the same as stages=1
        return None
    first = variant(call, block_m=cfg.block_m, num_warps=cfg.num_warps, grid=grid, stages=cfg.stages,
                    chunk=cfg.chunk)
    launches = [first] + [reduce_variant(red, grid) for red in rest]
    check_launches(launches)
    return launches


def check_launches(launches: list) -> None:
    """A kernel writing fp32 partials writes one row per program, and the reduction after it sums
    exactly those rows (a wrong count reads or writes past a buffer, silently in the interpreter)."""
    call, *rest = launches
    rows = {shape[0] for name, (shape, _) in call.out_specs.items() if name.endswith("_PART")}
    if rows and rows != {call.grid[0]}:
        raise ValueError(f"{call.name}: partial buffers of {sorted(rows)} rows for a grid of {call.grid[0]}")
    for red in rest:
        G = dict(zip(red.scalar_names, red.scalars))["G"]
        if rows != {G}:
            raise ValueError(f"{red.name} sums {G} partial rows; the kernel before it writes {sorted(rows)}")


def key(launches: list) -> tuple:
    return tuple((c.name, c.grid, c.num_warps, tuple(c.constexprs.items()), c.scalars) for c in launches)


def run(launches: list, arrays: dict) -> dict:
    """Launch the calls in order, the first on ``arrays``, each next one (a reduction) on the outputs so
    far; every output by name."""
    out = backend.launch(launches[0], arrays)
    for call in launches[1:]:
        out.update(backend.launch(call, out))
    return out


# ---------------------------------------------------------------------------------------------
# The base plans, captured from the driver.


class _Capture:
    """The Torch backend, recording each launch's plan and arrays."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        return getattr(backend, name)

    def launch(self, call, arrays, rows_shape=None):
        self.launches.append((call, dict(arrays)))
        return backend.launch(call, arrays, rows_shape)

    def plan(self) -> tuple[list, dict]:
        return [call for call, _ in self.launches], self.launches[0][1]


def plans(op: Op, arrays: dict, opts) -> dict:
    """mode -> (the KernelCalls normkit.driver launches for these arrays, the first one's arrays)."""
    x, r, w, b = arrays["x"], arrays.get("residual"), arrays.get("weight"), arrays.get("bias")
    out = {}
    cap = _Capture()
    driver.forward(cap, op, x, r, w, b, opts, False)
    out["fwd"] = cap.plan()
    _, s, mean, rstd, _, _ = driver.forward(backend, op, x, r, w, b, opts, True)
    b_dtype = backend.dtype(b) if b is not None else None
    for mode, grads in (("bwd_frozen", Grads(dx=True, dw=False)),
                        ("bwd_full", Grads(dx=True, dw=w is not None, db=b is not None))):
        cap = _Capture()
        driver.backward(cap, op, s if op.has_residual else x, w, arrays["dy"], arrays.get("ds"), mean, rstd, opts,
                        grads, b_dtype)
        out[mode] = cap.plan()
    return out


def agrees(out: dict, base: dict, dtype: str, M: int) -> bool:
    """Every result within the tolerance table of the base plan's result (which the test suite checks
    against the float64 reference)."""
    tol = TOLERANCES[dtype]
    for name, t in base.items():
        if name.endswith("_PART") or name in ("MEAN", "RSTD"):
            continue
        a, b = out[name].float(), t.float()
        atol = tol["atol"] * (M ** 0.5 if a.dim() == 1 else 1.0)
        if not bool(((a - b).abs() <= atol + tol["rtol"] * b.abs()).all()):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Inputs.


def inputs(op: Op, M: int, N: int, dtype: str, device) -> dict:
    """Random torch arrays of ``op`` on ``device``: x, dy (and the residual and ds), the parameters."""
    tdt, g = getattr(torch, dtype), torch.Generator(device=device).manual_seed(0)
    rows = lambda: torch.randn(M, N, device=device, dtype=tdt, generator=g)  # noqa: E731
    arrays = {"x": rows() * 1.5 + 0.3, "dy": rows()}
    if op.has_residual:
        arrays["residual"], arrays["ds"] = rows(), rows()
    if "weight" in op.params:
        arrays["weight"] = torch.rand(N, device=device, generator=g).add_(0.5).to(tdt)
    if "bias" in op.params:
        arrays["bias"] = (torch.randn(N, device=device, generator=g) * 0.5).to(tdt)
    return arrays


# ---------------------------------------------------------------------------------------------
# The sweep.


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", default=None, help=f"MxN,... (default {DEFAULT_SHAPES}; dry run {DRY_RUN_SHAPES})")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--top", type=int, default=4, help="configurations listed after the best")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=25.0)
    p.add_argument("--write-tiles", action="store_true",
                   help=f"write the RMSNorm forward tiles measured to {TILES.relative_to(ROOT)} (CUDA)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: launch every variant once in Triton's interpreter and check it against the "
                        "base plan; no timing")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    modes = args.modes.split(",")
    dtypes = args.dtypes.split(",")
    for name, given, known in (("op", ops, OPS), ("mode", modes, MODES), ("dtype", dtypes, TOLERANCES)):
        bad = [v for v in given if v not in known]
        if bad:
            p.error(f"unknown {name}(s) {bad}; expected some of {list(known)}")
    if args.write_tiles and args.dry_run:
        p.error("--write-tiles needs timings: run it on a CUDA GPU, without --dry-run")
    shapes = parse_list(args.shapes or (DRY_RUN_SHAPES if args.dry_run else DEFAULT_SHAPES))

    if args.dry_run:
        device = torch.device("cpu")
        copy = None
        print(f"dry run: Triton interpreter on the CPU ({backend.num_sms(torch.empty(0))} 'SMs'), every variant "
              "launched once and checked against the base plan; nothing timed", flush=True)
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: the sweep times compiled kernels (use --dry-run on a CPU)")
        device = torch.device("cuda")
        copy = Timer(args.warmup_ms, 4 * args.rep_ms).copy_bandwidth()["tbps"]
        print(f"{torch.cuda.get_device_name()}: copy {copy:.2f} TB/s (2 GiB bf16, read + write), "
              f"{backend.num_sms(torch.empty(0, device=device))} SMs", flush=True)

    choices = {}
    failures = run_all(shapes, ops, dtypes, modes, device, args, copy, choices)
    if failures:
        print(f"{failures} variant(s) disagreed with the base plan", flush=True)
    elif args.write_tiles:
        from benchmarks.env import versions

        v = versions()
        commit = f"{v['git']}-dirty" if v["git_dirty"] else v["git"]
        table = write_tiles(TILES, TILES_MEASURED, choices, torch.cuda.get_device_name(), commit, datetime.date.today().isoformat())
        print(f"wrote {TILES.relative_to(ROOT)}: {len(table['rms_forward'])} entries; {len(choices)} keys measured",
              flush=True)
    return 1 if failures else 0


def run_all(shapes, ops, dtypes, modes, device, args, copy, choices: dict) -> int:
    failures = 0
    for (M, N) in shapes:
        for op in (OPS[name] for name in ops):
            opts = op.options(eps=op.default_eps)  # the frontends' defaults (llama casting for the RMS ops)
            for dtype in dtypes:
                arrays = inputs(op, M, N, dtype, device)
                base_plans = plans(op, arrays, opts)
                for mode in modes:
                    failures += sweep(op, mode, dtype, M, N, base_plans[mode], backend.num_sms(arrays["x"]), args,
                                      copy, choices)
                del arrays, base_plans
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return failures


def sweep(op: Op, mode: str, dtype: str, M: int, N: int, base_plan: tuple, num_sms: int, args, copy,
          choices: dict) -> int:
    """Run every variant of one base plan; print one summary line. Returns the number of failures."""
    label = f"{op.name:19s} {mode:10s} {dtype:9s} {M}x{N}"
    plan, arrays = base_plan
    check_launches(plan)
    base_cfg = base_config(plan[0], num_sms)
    seen, variants = set(), []
    defaults = [default_config(plan[0])] if mode == "fwd" else []
    for cfg in [base_cfg] + defaults + configs(plan[0], mode):
        launches = plan if cfg == base_cfg else build(plan, cfg, M, num_sms)
        if launches is None or key(launches) in seen:
            continue
        seen.add(key(launches))
        variants.append((cfg, launches))
    with poisoned_outputs():  # the checked runs: every output starts as NaN, so an unwritten element shows
        base_out = run(plan, arrays)
    failures, results = 0, []
    for cfg, launches in variants:
        what = f"{op.name} {mode} {dtype} {M}x{N} {cfg}"  # assert_close's messages start with it
        try:
            with poisoned_outputs():
                out = run(launches, arrays)
            if not agrees(out, base_out, dtype, M):
                raise AssertionError(f"{what}: results differ from the base plan's beyond the tolerance table")
            us = None if args.dry_run else Timer(args.warmup_ms, args.rep_ms).kernel(
                lambda launches=launches: run(launches, arrays))
        except AssertionError as e:
            print(f"  FAIL {str(e).splitlines()[0]}", flush=True)
            failures += 1
            continue
        except Exception as e:  # a configuration that does not compile (e.g. out of shared memory)
            if args.dry_run:
                raise
            print(f"  skip {what}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        results.append((us, cfg))
    if args.dry_run:
        print(f"{label}: {len(results)}/{len(variants)} variants launched, "
              f"{'all within tolerance of the base plan' if not failures else f'{failures} FAILED'}", flush=True)
        return failures
    if not results:
        print(f"{label}: no variant ran", flush=True)
        return failures
    nbytes = bytemodel.bytes_moved(op.name, mode, M, N, ELEM_BYTES[dtype])
    pct = lambda us: 100 * tbps(nbytes, us) / copy  # noqa: E731
    results.sort(key=lambda r: r[0])
    best_us, best = results[0]
    choice = tile_choice(op, dtype, M, N, plan[0], results) if mode == "fwd" and op.is_rms else None
    if choice is not None and (choice[0] not in choices or M * N > choices[choice[0]]["M"] * choices[choice[0]]["N"]):
        choices[choice[0]] = choice[1]
    base_us = next(us for us, cfg in results if cfg == base_cfg) if any(c == base_cfg for _, c in results) else None
    base = f"{base_us:8.1f} us ({pct(base_us):5.1f}%)" if base_us is not None else "did not run"
    print(f"{label} best {best_us:8.1f} us ({pct(best_us):5.1f}% of copy) {best} | plan {base_cfg}: {base} | "
          f"{len(results)} variants; next: " +
          "; ".join(f"{us:.1f} {cfg}" for us, cfg in results[1:1 + args.top]), flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
