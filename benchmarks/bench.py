"""normkit against its peers, side by side in one process: RMSNorm, LayerNorm and fused add + RMSNorm.

Every op, mode (``fwd``, ``bwd_full``, ``bwd_frozen``, ``fwd_bwd``), dtype (bf16, fp32) and shape of
``normkit.shapes`` ("bench" and "model"), through normkit's bare launches (``kernel``: device time)
and through each implementation's public API (``e2e``: wall time per call, back to back):
``normkit`` (torch_frontend), ``normkit_jax`` / ``normkit_jax_pallas`` / ``normkit_jax_xla``
(jax_frontend with ``implementation=`` None / "pallas" / "xla"), ``liger``, ``torch_eager``,
``torch_compile`` and ``xla`` (jax.jit of a jnp expression). A time budget orders the work (bf16 then
fp32 on the M >= 8192, N >= 4096 shapes, then the smaller ones, then the model shapes) and records what
it did not reach as skipped; ``--merge FILE --skip-done`` continues a results file. The timers are
benchmarks/timing.py's, the byte model benchmarks/bytemodel.py's; the JSON schema and the flags are in
benchmarks/README.md. ``--dry-run`` runs one tiny shape on the CPU (Triton's interpreter): the whole
pipeline, numbers that mean nothing.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks import bytemodel  # noqa: E402
from benchmarks.env import short_error, versions  # noqa: E402
from benchmarks.timing import Timer, num_sets, tbps  # noqa: E402

SCHEMA = "normkit-bench/1"
OPS = bytemodel.OPS
MODES = bytemodel.MODES
DTYPES = tuple(bytemodel.DTYPES)
TORCH_PEERS = ("liger", "torch_eager", "torch_compile")
NORMKIT_JAX = ("normkit_jax", "normkit_jax_pallas", "normkit_jax_xla")  # jax_frontend, implementation= auto/pallas/xla
JAX_PEERS = ("xla",) + NORMKIT_JAX
ALL_PEERS = TORCH_PEERS + JAX_PEERS
PEER_GROUPS = {"jax_impls": NORMKIT_JAX}  # --peers jax-impls: the three implementations of jax_frontend
QUICK_SHAPES = ("4096x1024", "8192x8192", "32768x4096")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "h200.json"
DRY_OUT = Path("/tmp/normkit-bench-dry/dry.json")
DRY_SHAPE = ("dry_32x256", (32, 256))  # --dry-run only: two row tiles, interpreted in milliseconds
HEADLINE = (8192, 4096)  # M >= 8192 and N >= 4096: the shapes the README's table summarizes


def log(msg: str, t0=[time.perf_counter()]) -> None:  # noqa: B006 (the start time)
    print(f"[{time.perf_counter() - t0[0]:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Arguments and the work list.


def _csv(value: str | None, allowed, groups: dict = {}) -> list[str] | None:  # noqa: B006
    """A comma list of names from ``allowed`` (dashes for underscores; a group name for its members)."""
    if value is None:
        return None
    out = []
    for item in (v.strip().replace("-", "_") for v in value.split(",") if v.strip()):
        for name in groups.get(item, (item,)):
            if name not in allowed:
                raise SystemExit(f"bench: unknown value {name!r}; expected one of {', '.join(allowed)}")
            out.append(name)
    return list(dict.fromkeys(out))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument("--dtypes", help="comma list of bf16, fp32 (default both)")
    p.add_argument("--shapes", help="comma list of shape names, tags (bench, model) or MxN (default bench,model)")
    p.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default all)")
    p.add_argument("--peers", help=f"comma list of {', '.join(ALL_PEERS)}, jax-impls (= {', '.join(NORMKIT_JAX)}), "
                                   "or none (default all); normkit (torch) always runs")
    p.add_argument("--quick", action="store_true", help=f"bf16 on {', '.join(QUICK_SHAPES)} only")
    p.add_argument("--cells", action="store_true",
                   help="only the 81 cells of the Torch end-to-end table (report.CELL_SHAPES x CELL_MODES x "
                        "the ops), against the Torch peers (default --peers liger,torch_eager,torch_compile)")
    p.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--merge", type=Path, help="start from this results JSON; new records replace equal keys")
    p.add_argument("--skip-done", action="store_true", help="with --merge: keep error-free records, time the rest")
    p.add_argument("--dry-run", action="store_true", help="CPU, one tiny shape, interpreter, wall-clock timings")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new measurements after this many seconds (default 300; 0: none, the dry "
                        "run's default)")
    p.add_argument("--compile-budget-s", type=float, default=150.0,
                   help="stop starting torch.compile items after this many seconds spent in them (0: none)")
    p.add_argument("--no-report", action="store_true", help="do not write the Markdown report")
    p.add_argument("--readme", type=Path, help="README whose table (between its bench markers) to rewrite")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.cell_pairs = None
    if args.cells:  # the table's (dtype, shape) pairs; work_items leaves out the other pairs
        from benchmarks.report import CELL_MODES, CELL_SHAPES

        args.shapes = args.shapes or ",".join(dict.fromkeys(shape for _, shape in CELL_SHAPES))
        args.modes = args.modes or ",".join(CELL_MODES)
        args.peers = args.peers or ",".join(TORCH_PEERS)
        args.cell_pairs = None if args.dry_run else set(CELL_SHAPES)
    args.ops = _csv(args.ops, OPS) or list(OPS)
    args.modes = _csv(args.modes, MODES) or list(MODES)
    args.dtypes = _csv(args.dtypes, DTYPES) or (["bf16"] if args.quick else list(DTYPES))
    args.peers = [] if (args.peers or "").strip().lower() == "none" else (
        _csv(args.peers, ALL_PEERS, PEER_GROUPS) or list(ALL_PEERS))
    args.out = args.out or (DRY_OUT if args.dry_run else DEFAULT_OUT)
    args.compile_backend = "aot_eager" if args.dry_run else "inductor"
    if args.budget_s is None:
        args.budget_s = 0.0 if args.dry_run else 300.0
    return args


class Target:
    """One measured M x N and the shape names it stands for."""

    def __init__(self, name: str, M: int, N: int, aliases=()):
        self.name, self.M, self.N, self.aliases = name, M, N, list(aliases)

    @property
    def headline(self) -> bool:
        return self.M >= HEADLINE[0] and self.N >= HEADLINE[1]


def select_targets(args) -> list[Target]:
    """Unique M x N targets in priority order, with the names of equal shapes as aliases."""
    from normkit.shapes import Shape, parse, shapes

    if args.dry_run:
        return [Target(DRY_SHAPE[0], *DRY_SHAPE[1])]
    by_name = {s.name: s for s in shapes("bench") + shapes("model")}
    chosen: list[Shape] = []
    for item in (args.shapes or (",".join(QUICK_SHAPES) if args.quick else "bench,model")).split(","):
        item = item.strip()
        if item in ("bench", "model", "gpu", "ci"):
            chosen += shapes(item)
        elif item in by_name:
            chosen.append(by_name[item])
        else:
            try:
                M, N = parse(item)
            except ValueError:
                raise SystemExit(f"bench: unknown shape {item!r}; names: {', '.join(by_name)}, or MxN") from None
            chosen.append(next((s for s in by_name.values() if (s.M, s.N) == (M, N)), Shape(item, (M, N), frozenset())))
    targets: dict[tuple[int, int], Target] = {}
    for s in chosen:
        t = targets.setdefault((s.M, s.N), Target(s.name, s.M, s.N))
        if s.name != t.name and s.name not in t.aliases:
            t.aliases.append(s.name)
    return sorted(targets.values(), key=lambda t: _group(t, args))  # stable: list order within a group


def _group(t: Target, args) -> int:
    """Priority: 0 the M >= 8192, N >= 4096 bench shapes, 1 the other bench shapes, 2 model-only shapes."""
    from normkit.shapes import shapes

    if args.dry_run:
        return 0
    if t.name not in {s.name for s in shapes("bench")}:
        return 2
    return 0 if t.headline else 1


def work_items(args, targets: list[Target]):
    """(target, dtype) in priority order: each group of shapes in bf16, then in fp32."""
    for g in sorted({_group(t, args) for t in targets}):
        for dtype in args.dtypes:
            for t in targets:
                if _group(t, args) == g and (args.cell_pairs is None or any(
                        (dtype, name) in args.cell_pairs for name in (t.name, *t.aliases))):
                    yield t, dtype


# ---------------------------------------------------------------------------------------------
# Results.


def _key(r: dict) -> tuple:
    return (r["op"], r["mode"], r["dtype"], r["shape"], r["impl"], r["path"])


class Results:
    def __init__(self, out: Path, merge: Path | None, skip_done: bool):
        self.out = out
        self.records: dict[tuple, dict] = {}
        self.runs: list[dict] = []
        self.done: set[tuple] = set()
        if merge is not None and merge.exists():
            prev = json.loads(merge.read_text())
            self.runs = list(prev.get("runs", []))
            for r in prev.get("records", []):
                self.records[_key(r)] = r
                if skip_done and r.get("error") is None:
                    self.done.add(_key(r))

    def add(self, rec: dict) -> None:
        self.records[_key(rec)] = rec

    def write(self, run: dict) -> None:
        runs = [r for r in self.runs if r["run_id"] != run["run_id"]] + [run]
        head = {"schema": SCHEMA, "device": run["device"], "versions": run["versions"], "copy": run["copy"],
                "byte_model": byte_model_doc(), "runs": runs}
        text = json.dumps(head, indent=1, sort_keys=False)
        recs = sorted(self.records.values(), key=lambda r: (OPS.index(r["op"]) if r["op"] in OPS else 9,
                                                            r["dtype"], r["M"], r["N"], r["shape"],
                                                            MODES.index(r["mode"]) if r["mode"] in MODES else 9,
                                                            r["impl"], r["path"]))
        body = ",\n  ".join(json.dumps(r, sort_keys=True) for r in recs)
        text = text[:-2] + ',\n "records": [\n  ' + body + "\n ]\n}\n"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.out)


def byte_model_doc() -> dict:
    return {op: {mode: list(bytemodel.terms(op, mode, 1, 1, 2)) for mode in MODES} for op in OPS}


def _sig(x, digits=6):
    return None if x is None else float(f"{x:.{digits}g}")


def make_record(*, op, mode, dtype, target: Target, impl, path, run, res=None, error=None, timer="", n_sets=1):
    M, N = target.M, target.N
    nbytes = bytemodel.bytes_moved(op, mode, M, N, bytemodel.itemsize(dtype))
    res = dict(res or {})
    us = res.pop("median_us", None)
    if us is not None and not (us > 0):
        error, us = error or f"non-positive time {us}", None
    peak = res.pop("peak_mem_bytes", None)
    bw = tbps(nbytes, us) if us else None
    copy_tbps = run["copy"].get("tbps")
    return {
        "op": op, "mode": mode, "dtype": dtype, "shape": target.name, "M": M, "N": N, "impl": impl, "path": path,
        "median_us": _sig(us), "bytes": nbytes, "tbps": _sig(bw),
        "pct_copy": None if bw is None or not copy_tbps else _sig(100 * bw / copy_tbps),
        "peak_mem_bytes": peak, "error": error, "run_id": run["run_id"], "timer": timer,
        "n_sets": n_sets, "measured_as": None, "extra": res,
    }


# ---------------------------------------------------------------------------------------------
# Environment.


def device_info(torch, dry: bool) -> dict:
    if dry:
        return {"name": f"CPU ({platform.processor() or platform.machine()}), dry run", "type": "cpu"}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "type": "cuda", "sms": props.multi_processor_count,
            "memory_bytes": props.total_memory, "l2_bytes": getattr(props, "L2_cache_size", None),
            "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}


def load_peers(args):
    """Import every selected peer, torch side first; return (status, torch fns, jax fns)."""
    from benchmarks import impls_torch as it

    status: dict[str, str] = {"normkit": "ok"}
    torch_fns = {"normkit": it.normkit_fn}
    jax_fns = {}
    for peer, make in (("liger", it.liger_fn), ("torch_eager", it.eager_fn), ("torch_compile", None)):
        if peer not in args.peers:
            continue
        try:
            if peer == "liger":
                import liger_kernel.ops.fused_add_rms_norm  # noqa: F401
                import liger_kernel.ops.layer_norm  # noqa: F401
                import liger_kernel.ops.rms_norm  # noqa: F401
            if peer == "torch_compile":
                it.configure_dynamo()  # built per item
            torch_fns[peer] = make
            status[peer] = f"ok (backend {args.compile_backend})" if peer == "torch_compile" else "ok"
        except Exception as e:  # noqa: BLE001
            status[peer] = f"unavailable: {short_error(e)}"
    want_jax = [p for p in JAX_PEERS if p in args.peers]
    if not want_jax:
        return status, torch_fns, jax_fns
    try:
        import jax

        if args.dry_run:
            jax.config.update("jax_platforms", "cpu")
        elif jax.default_backend() != "gpu":
            raise RuntimeError(f"JAX runs on {jax.default_backend()}, not on the GPU")
        from benchmarks import impls_jax as ij
    except Exception as e:  # noqa: BLE001
        status.update({p: f"unavailable: jax: {short_error(e)}" for p in want_jax})
        return status, torch_fns, jax_fns
    for impl in want_jax:
        try:
            if impl == "xla":
                jax_fns[impl], status[impl] = ij.xla_fn, "ok"
                continue
            import jax_frontend as jf

            # Raises when the requested implementation cannot run here (never a silent fallback); for
            # auto, names the one that runs (the report's "Triton" column is that one).
            resolved = jf.resolve_implementation(ij.NORMKIT_JAX_IMPLS[impl])
            jax_fns[impl] = lambda op, impl=impl: ij.normkit_jax_fn(op, ij.NORMKIT_JAX_IMPLS[impl])
            status[impl] = f"ok (implementation {resolved})"
        except Exception as e:  # noqa: BLE001
            status[impl] = f"unavailable: {short_error(e)}"
    return status, torch_fns, jax_fns


# ---------------------------------------------------------------------------------------------
# The run.


class Budget:
    """What is left of ``total_s`` seconds since ``t0`` and of ``compile_s`` seconds of torch.compile items."""

    def __init__(self, total_s: float, compile_s: float, t0: float):
        self.total_s, self.compile_s, self.t0, self.compile_spent, self.skipped = total_s, compile_s, t0, 0.0, 0

    def reason(self, impl: str) -> str | None:
        if self.total_s and time.perf_counter() - self.t0 > self.total_s:
            return f"skipped: time budget of {self.total_s:g} s spent"
        if impl == "torch_compile" and self.compile_s and self.compile_spent > self.compile_s:
            return f"skipped: torch.compile budget of {self.compile_s:g} s spent"
        return None


def run_item(args, target: Target, dtype: str, ctx) -> None:
    """Every op at one (shape, dtype): normkit's bare launches and each Torch implementation on one set
    of inputs, then each JAX implementation on another; the records go to ``ctx["results"]``."""
    from benchmarks import impls_torch as it

    torch, timer, results, budget, device = ctx["torch"], ctx["timer"], ctx["results"], ctx["budget"], ctx["device"]
    M, N = target.M, target.N
    timers = {"kernel": "do_bench", "e2e": "loop"} if timer.name == "gpu" else {"kernel": "perf_counter",
                                                                                "e2e": "perf_counter"}
    for op in args.ops:
        # Rotate input sets past the L2; on the CPU (dry run) there is nothing to learn from rotating.
        k = 1 if args.dry_run else num_sets(bytemodel.input_set_bytes(op, M, N, bytemodel.itemsize(dtype)))
        recs: list[dict] = []

        def emit(impl, path, mode, res=None, error=None):
            rec = make_record(op=op, mode=mode, dtype=dtype, target=target, impl=impl, path=path, run=ctx["run"],
                              res=res, error=error, timer=timers[path], n_sets=k)
            recs.append(rec)
            if error and not error.startswith("skipped"):  # skipped ones are counted in one line below
                log(f"{op} {dtype} {target.name} {mode:10s} {impl:18s} {path:6s} ERROR {error[:160]}")
                if ctx["verbose_errors"]:
                    traceback.print_exc()
            elif not error:
                log(f"{op} {dtype} {target.name} {mode:10s} {impl:18s} {path:6s} {rec['median_us']:10.1f} us "
                    f"{rec['tbps']:6.2f} TB/s {rec['pct_copy']:6.1f}% of copy")

        def todo(impl, path, mode) -> bool:
            return (op, mode, dtype, target.name, impl, path) not in results.done and not any(
                (r["impl"], r["path"], r["mode"]) == (impl, path, mode) for r in recs)

        def measure(impl, path, mode, fn):
            if not todo(impl, path, mode):
                return
            why = budget.reason(impl)
            if why:
                budget.skipped += 1
                return emit(impl, path, mode, error=why)
            try:
                emit(impl, path, mode, res=fn())
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                emit(impl, path, mode, error=short_error(e))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()

        torch_side = [("normkit", "kernel")] + [(i, "e2e") for i in ctx["torch_fns"]]
        sides = [("torch", torch_side, lambda: it.TorchInputs(op, M, N, dtype, device, k, seed=args.seed))]
        if ctx["jax_fns"]:
            from benchmarks import impls_jax as ij

            sides.append(("jax", [(i, "e2e") for i in ctx["jax_fns"]],
                          lambda: ij.JaxInputs(op, M, N, dtype, k, seed=args.seed)))
        for side, impls, make_inputs in sides:
            if not any(todo(impl, path, mode) for impl, path in impls for mode in args.modes):
                continue  # done in the merged results
            inp = None
            try:
                if budget.reason("normkit") is None:  # out of time: skip without allocating anything
                    inp = make_inputs()
                for impl, path in impls:
                    if path == "kernel":
                        for mode in args.modes:
                            measure(impl, path, mode, lambda: it.time_kernel(inp, mode, timer, device))
                        continue
                    t0 = time.perf_counter()
                    try:
                        if inp is None or not any(todo(impl, path, m) for m in args.modes) or budget.reason(impl):
                            f = None  # measure() records the budget's reason, or nothing is left to do
                        elif side == "jax":
                            f = ij.Jitted(op, ctx["jax_fns"][impl](op))
                        else:
                            f = it.Compiled(op, args.compile_backend) if impl == "torch_compile" else \
                                ctx["torch_fns"][impl](op)
                    except Exception as e:  # noqa: BLE001
                        for mode in args.modes:
                            emit(impl, path, mode, error=short_error(e))
                        continue
                    for mode in args.modes:
                        measure(impl, path, mode, (lambda: ij.time_e2e(f, inp, mode, timer)) if side == "jax" else (
                            lambda: it.time_e2e(f, inp, mode, timer, device, compiled=f if impl == "torch_compile"
                                                else None)))
                    if impl == "torch_compile":
                        budget.compile_spent += time.perf_counter() - t0
                        torch._dynamo.reset()
            except Exception as e:  # noqa: BLE001 (e.g. out of memory allocating the inputs)
                for impl, path in impls:
                    for mode in args.modes:
                        if todo(impl, path, mode):
                            emit(impl, path, mode, error=f"setup: {short_error(e)}")
            finally:
                if inp is not None:
                    inp.free()
                inp = None
                gc.collect()
                if side == "jax":
                    import jax

                    jax.clear_caches()
                elif device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        skipped = [r for r in recs if (r["error"] or "").startswith("skipped")]
        if skipped:
            log(f"   {len(skipped)} measurements of {op} {dtype} {target.name} {skipped[0]['error']}")
        for rec in recs:
            results.add(rec)
            for alias in target.aliases:
                results.add({**rec, "shape": alias, "measured_as": target.name})


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    # Before JAX is imported anywhere: allocate on demand, so that JAX and torch share the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    import torch

    if args.dry_run:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("bench: no CUDA device; run on the GPU machine, or pass --dry-run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        torch.cuda.set_device(0)
    import torch_frontend  # noqa: F401 (normkit itself must import)

    targets = select_targets(args)
    status, torch_fns, jax_fns = load_peers(args)
    for impl, st in status.items():
        log(f"impl {impl:18s} {st}")
    timer = Timer(dry=True) if args.dry_run else Timer(args.warmup_ms, args.rep_ms)
    copy = timer.copy_bandwidth()
    log(f"copy bandwidth {copy['tbps']:.3f} TB/s ({copy['what']}, median {copy['median_us']:.1f} us)")
    run = {"run_id": started, "started": started, "wall_s": None, "argv": sys.argv[1:] if argv is None else list(argv),
           "dry_run": args.dry_run, "device": device_info(torch, args.dry_run), "versions": versions(), "copy": copy,
           "peers": status,
           "timer": {"kernel": "triton.testing.do_bench median, L2 flushed per call" if timer.name == "gpu"
                     else "wall clock, one call (dry run)",
                     "e2e": "torch.utils.benchmark.Timer: median over 5 blocks of back-to-back calls, one sync per "
                            "block" if timer.name == "gpu" else "wall clock, one call (dry run)",
                     "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms},
           "budget": {"total_s": args.budget_s, "compile_s": args.compile_budget_s, "skipped": 0}}
    results = Results(args.out, args.merge, args.skip_done)
    budget = Budget(args.budget_s, args.compile_budget_s, t_start)
    ctx = {"torch": torch, "device": device, "timer": timer, "run": run, "results": results, "budget": budget,
           "torch_fns": torch_fns, "jax_fns": jax_fns,
           "verbose_errors": bool(os.environ.get("NORMKIT_BENCH_TRACE"))}
    items = list(work_items(args, targets))
    log(f"{len(items)} (shape, dtype) items x {len(args.ops)} ops x {len(args.modes)} modes; "
        f"budget {args.budget_s:.0f} s (torch.compile {args.compile_budget_s:.0f} s)")
    for n, (target, dtype) in enumerate(items, 1):
        alias = f" (= {', '.join(target.aliases)})" if target.aliases else ""
        log(f"== {n}/{len(items)} {target.name}{alias} {dtype}")
        run_item(args, target, dtype, ctx)
        run["wall_s"] = round(time.perf_counter() - t_start, 1)
        run["budget"]["skipped"] = budget.skipped
        results.write(run)
    run["wall_s"] = round(time.perf_counter() - t_start, 1)
    run["budget"]["skipped"] = budget.skipped
    results.write(run)
    log(f"wrote {args.out} ({len(results.records)} records; {budget.skipped} skipped by the budget)")
    if not args.no_report:
        try:
            from benchmarks import report

            written = report.generate(args.out, readme=args.readme)
            for path in written:
                log(f"wrote {path}")
        except Exception as e:  # noqa: BLE001 (the JSON is what matters)
            log(f"report failed: {short_error(e)}")
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
