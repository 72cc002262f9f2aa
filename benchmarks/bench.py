"""normkit against its peers, side by side in one process: RMSNorm, LayerNorm and fused add + RMSNorm.

On the GPU machine, from the repository root (see benchmarks/README.md)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:.
    TRITON_CACHE_DIR=/tmp/triton_cache HOME=/tmp python3 benchmarks/bench.py

On CPU, ``--dry-run`` runs one tiny shape through Triton's interpreter with perf_counter timings, to
exercise the whole pipeline (JSON, report, plots); its numbers mean nothing.

What is timed (each combination of):

- ops ``rms_norm``, ``layer_norm``, ``fused_add_rms_norm``; dtypes ``bf16``, ``fp32`` (the weight
  has x's dtype); the ``bench`` and ``model`` shapes of ``normkit.shapes`` (shapes with equal M x N
  are timed once; the others' records say ``measured_as``);
- modes ``fwd`` (inference forward, no statistics stored), ``bwd_full`` (gradients of every input),
  ``bwd_frozen`` (weight and bias frozen, x and the residual trainable), ``fwd_bwd`` (training
  forward then full backward);
- impls ``normkit`` (torch_frontend), ``normkit_jax`` (jax_frontend, ``implementation=None``: Triton
  through jax-triton on the GPU), ``normkit_jax_pallas`` and ``normkit_jax_xla`` (jax_frontend with
  ``implementation="pallas"`` / ``"xla"``: the same custom_vjp and frozen semantics over the Pallas
  kernels / plain jax.numpy), ``liger`` (Liger-Kernel), ``torch_eager``, ``torch_compile``, ``xla``
  (jax.jit of a jnp reference, JAX's own autodiff), ``tokamax``; ``--peers jax-impls`` selects the
  three normkit_jax* only (the report's "Triton vs Pallas vs XLA" table);
- paths ``kernel`` (normkit's bare launches ``_norm_fwd``/``_norm_bwd``, do_bench device time) and
  ``e2e`` (through each frontend's public API and autograd / jax.vjp; back-to-back calls, wall time).

Timers and the copy are described in benchmarks/timing.py, the byte model in benchmarks/bytemodel.py.

A time budget (``--budget-s``, ``--compile-budget-s``) bounds the run: work is ordered by priority
(bf16 then fp32 on the M >= 8192, N >= 4096 shapes, then the small shapes, then model-only shapes)
and what the budget does not reach is recorded as skipped. ``--merge FILE --skip-done`` continues a
previous results file.

JSON schema (``--out``, default benchmarks/results/h200.json)::

    {
      "schema": "normkit-bench/1",
      "device":   {...},            # of the latest run: name, sms, memory_bytes, l2_bytes, capability, ...
      "versions": {...},            # of the latest run: python, torch, triton, jax, jaxlib, numpy,
                                    #   liger-kernel, jax-triton, normkit, git commit
      "copy":     {"bytes", "median_us", "tbps", "what", "timer"},   # of the latest run
      "byte_model": {op: {mode: [term, ...]}},                        # what "bytes" counts
      "runs": [{"run_id", "started", "wall_s", "argv", "dry_run", "device", "versions", "copy",
                "peers": {impl: "ok" | reason unavailable}, "timer": {...}, "budget": {...}}],
      "records": [{
          "op", "mode", "dtype", "shape", "M", "N", "impl", "path",
          "median_us":      float | null,   # null when error
          "bytes":          int,            # byte model of (op, mode, M, N, dtype)
          "tbps":           float | null,   # bytes / median_us
          "pct_copy":       float | null,   # 100 * tbps / the copy bandwidth of the record's run
          "peak_mem_bytes": int | null,     # torch: max_memory_allocated delta of one call (outputs
                                            #   included); JAX: XLA memory_analysis (see mem_method)
          "error":          str | null,     # exception, or "skipped: ..." when the budget ran out
          "speedup_vs":     {impl: float} | null,  # normkit e2e records: peer median / this median
          "run_id", "timer", "n_sets", "measured_as", "extra": {...}   # partial_bytes, compile evidence, ...
      }, ...]
    }
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
JAX_PEERS = ("xla",) + NORMKIT_JAX + ("tokamax",)
PEER_ALIASES = {"eager": "torch_eager", "compile": "torch_compile", "jax": "normkit_jax",
                "normkit-jax": "normkit_jax", "torch-eager": "torch_eager", "torch-compile": "torch_compile",
                "pallas": "normkit_jax_pallas", "jax_pallas": "normkit_jax_pallas", "jax_xla": "normkit_jax_xla"}
PEER_GROUPS = {"jax_impls": NORMKIT_JAX}  # --peers jax-impls: the three implementations of jax_frontend
ALL_PEERS = TORCH_PEERS + JAX_PEERS
QUICK_SHAPES = ("4096x1024", "8192x8192", "32768x4096")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "h200.json"
DRY_OUT = Path("/tmp/normkit-bench-dry/dry.json")
OP_ALIASES = {"rmsnorm": "rms_norm", "layernorm": "layer_norm", "fusedaddrmsnorm": "fused_add_rms_norm",
              "fused_add": "fused_add_rms_norm", "fused": "fused_add_rms_norm"}
DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}
DRY_SHAPE = ("dry_32x256", (32, 256))  # --dry-run only: two row tiles, interpreted in milliseconds
HEADLINE = (8192, 4096)  # M >= 8192 and N >= 4096: the shapes the targets are stated for


def log(msg: str, t0=[time.perf_counter()]) -> None:  # noqa: B006 (the start time)
    print(f"[{time.perf_counter() - t0[0]:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Arguments and the work list.


def _csv(value: str | None, aliases: dict, allowed) -> list[str] | None:
    if value is None:
        return None
    out = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        norm = item.lower().replace("-", "_")
        item = aliases.get(norm, aliases.get(item.lower(), item))
        if allowed is not None and item not in allowed and norm in allowed:
            item = norm  # normkit-jax-pallas: dashes for underscores
        if allowed is not None and item not in allowed:
            raise SystemExit(f"bench: unknown value {item!r}; expected one of {', '.join(allowed)}")
        out.append(item)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument("--dtypes", help="comma list of bf16, fp32 (default both)")
    p.add_argument("--shapes", help="comma list of shape names, tags (bench, model) or MxN (default bench,model)")
    p.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default all)")
    p.add_argument("--peers", help=f"comma list of {', '.join(ALL_PEERS)} (aliases: pallas, jax-xla; "
                                   f"jax-impls = {', '.join(NORMKIT_JAX)}), or 'none' (default all); "
                                   "normkit (torch) always runs")
    p.add_argument("--quick", action="store_true", help=f"bf16 on {', '.join(QUICK_SHAPES)} only")
    p.add_argument("--cells", action="store_true",
                   help="only the 81 cells of the Torch end-to-end table (report.CELL_SHAPES x CELL_MODES x "
                        "the ops), against the Torch peers (default --peers liger,torch_eager,torch_compile)")
    p.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--merge", type=Path, help="start from this results JSON; new records replace equal keys")
    p.add_argument("--skip-done", action="store_true", help="with --merge: keep error-free records, time the rest")
    p.add_argument("--dry-run", action="store_true", help="CPU, one tiny shape, interpreter, perf_counter timings")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop starting new measurements after this many seconds of the process (0: none)")
    p.add_argument("--compile-budget-s", type=float, default=150.0,
                   help="stop starting torch.compile items after this many seconds spent in them (0: none)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; aot_eager "
                                                           "in --dry-run)")
    p.add_argument("--no-report", action="store_true", help="do not write the markdown report and plots")
    p.add_argument("--readme", type=Path, help="README whose bench markers to rewrite (default: the "
                                                 "repository's README.md; none in --dry-run)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cells:  # the table's (dtype, shape) pairs; work_items leaves out the other pairs
        from benchmarks.report import CELL_MODES, CELL_SHAPES

        args.shapes = args.shapes or ",".join(dict.fromkeys(shape for _, shape in CELL_SHAPES))
        args.modes = args.modes or ",".join(CELL_MODES)
        args.peers = args.peers or ",".join(TORCH_PEERS)
        args.cell_pairs = None if args.dry_run else set(CELL_SHAPES)
    else:
        args.cell_pairs = None
    args.ops = _csv(args.ops, OP_ALIASES, OPS) or list(OPS)
    args.modes = _csv(args.modes, {}, MODES) or list(MODES)
    default_dtypes = ["bf16"] if args.quick else list(DTYPES)
    args.dtypes = _csv(args.dtypes, DTYPE_ALIASES, DTYPES) or default_dtypes
    if args.peers is not None and args.peers.strip().lower() == "none":
        args.peers = []
    else:
        if args.peers is not None:  # expand groups (jax-impls) before the per-name check
            args.peers = ",".join(",".join(PEER_GROUPS.get(item.strip().lower().replace("-", "_"), (item,)))
                                  for item in args.peers.split(","))
        args.peers = _csv(args.peers, PEER_ALIASES, ALL_PEERS)
        args.peers = list(ALL_PEERS) if args.peers is None else list(dict.fromkeys(args.peers))
    if args.out is None:
        args.out = DRY_OUT if args.dry_run else DEFAULT_OUT
    if args.readme is None and not args.dry_run:
        args.readme = REPO / "README.md"
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.dry_run else "inductor"
    if args.dry_run:
        args.budget_s = args.budget_s if "--budget-s" in (argv or sys.argv) else 0.0
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
    wanted = args.shapes or (",".join(QUICK_SHAPES) if args.quick else "bench,model")
    chosen: list[Shape] = []
    for item in wanted.split(","):
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
        key = (s.M, s.N)
        if key not in targets:
            targets[key] = Target(s.name, s.M, s.N)
        elif s.name != targets[key].name and s.name not in targets[key].aliases:
            targets[key].aliases.append(s.name)
    bench_names = {s.name for s in shapes("bench")}

    def priority(t: Target) -> int:
        if t.name in bench_names:
            return 0 if t.headline else 1
        return 2

    return sorted(targets.values(), key=priority)  # stable: list order within a group


def work_items(args, targets: list[Target]):
    """(target, dtype) in priority order: each group of shapes in bf16, then in fp32."""
    groups: dict[int, list[Target]] = {}
    from normkit.shapes import shapes

    bench_names = {s.name for s in shapes("bench")}
    for t in targets:
        g = 2 if t.name not in bench_names and not args.dry_run else (0 if t.headline or args.dry_run else 1)
        groups.setdefault(g, []).append(t)
    for g in sorted(groups):
        for dtype in args.dtypes:
            for t in groups[g]:
                if args.cell_pairs is None or any((dtype, name) in args.cell_pairs for name in (t.name, *t.aliases)):
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
        groups: dict[tuple, list[dict]] = {}
        for r in self.records.values():
            groups.setdefault((r["op"], r["mode"], r["dtype"], r["shape"]), []).append(r)
        for recs in groups.values():
            add_speedups(recs)
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
        "peak_mem_bytes": peak, "error": error, "speedup_vs": None, "run_id": run["run_id"], "timer": timer,
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


def _restore_cache_dir(saved: str | None) -> None:
    """jax_triton 0.3.1 sets TRITON_CACHE_DIR to "" at import; put back what the process started with."""
    if saved is None:
        if os.environ.get("TRITON_CACHE_DIR", None) == "":
            del os.environ["TRITON_CACHE_DIR"]
    else:
        os.environ["TRITON_CACHE_DIR"] = saved


def load_peers(args, saved_cache_dir):
    """Import every selected peer, torch side first; return (status, torch fns, jax fns)."""
    from benchmarks import impls_torch as it

    status: dict[str, str] = {"normkit": "ok"}
    torch_fns = {"normkit": it.normkit_fn}
    jax_fns = {}
    if "liger" in args.peers:
        try:
            import liger_kernel.ops.fused_add_rms_norm  # noqa: F401
            import liger_kernel.ops.layer_norm  # noqa: F401
            import liger_kernel.ops.rms_norm  # noqa: F401

            torch_fns["liger"] = it.liger_fn
            status["liger"] = "ok"
        except Exception as e:  # noqa: BLE001
            status["liger"] = f"unavailable: {short_error(e)}"
    if "torch_eager" in args.peers:
        torch_fns["torch_eager"] = it.eager_fn
        status["torch_eager"] = "ok"
    if "torch_compile" in args.peers:
        try:
            it.configure_dynamo()
            torch_fns["torch_compile"] = None  # built per item
            status["torch_compile"] = f"ok (backend {args.compile_backend})"
        except Exception as e:  # noqa: BLE001
            status["torch_compile"] = f"unavailable: {short_error(e)}"
    want_jax = [p for p in JAX_PEERS if p in args.peers]
    if want_jax:
        try:
            import jax

            if args.dry_run:
                jax.config.update("jax_platforms", "cpu")
            elif jax.default_backend() != "gpu":
                raise RuntimeError(f"JAX runs on {jax.default_backend()}, not on the GPU")
        except Exception as e:  # noqa: BLE001
            for p in want_jax:
                status[p] = f"unavailable: jax: {short_error(e)}"
            want_jax = []
        _restore_cache_dir(saved_cache_dir)
        from benchmarks import impls_jax as ij

        if "xla" in want_jax:
            jax_fns["xla"] = ij.xla_fn
            status["xla"] = "ok"
        for impl in NORMKIT_JAX:
            if impl not in want_jax:
                continue
            try:
                import jax_frontend as jf

                for name in ("rms_norm", "layer_norm", "fused_add_rms_norm"):
                    if not callable(getattr(jf, name, None)):
                        raise ImportError(f"jax_frontend has no {name}")
                # Raises when the requested implementation cannot run here (never a silent fallback);
                # for auto, names the one that runs (the report's "Triton" column is that one).
                resolved = jf.resolve_implementation(ij.NORMKIT_JAX_IMPLS[impl])
                jax_fns[impl] = ij.NORMKIT_JAX_FNS[impl]
                status[impl] = f"ok (implementation {resolved})"
            except Exception as e:  # noqa: BLE001
                status[impl] = f"unavailable: {short_error(e)}"
            _restore_cache_dir(saved_cache_dir)
        if "tokamax" in want_jax:
            try:
                import tokamax  # noqa: F401

                jax_fns["tokamax"] = ij.tokamax_fn
                status["tokamax"] = "ok"
            except Exception as e:  # noqa: BLE001
                status["tokamax"] = f"not available on this stack: {short_error(e)}"
            _restore_cache_dir(saved_cache_dir)
    return status, torch_fns, jax_fns


# ---------------------------------------------------------------------------------------------
# The run.


class Budget:
    def __init__(self, total_s: float, compile_s: float):
        self.total_s, self.compile_s = total_s, compile_s
        self.t0 = time.perf_counter()
        self.compile_spent = 0.0
        self.skipped = 0

    def reason(self, impl: str) -> str | None:
        if self.total_s and time.perf_counter() - self.t0 > self.total_s:
            return f"skipped: time budget of {self.total_s:g} s spent"
        if impl == "torch_compile" and self.compile_s and self.compile_spent > self.compile_s:
            return f"skipped: torch.compile budget of {self.compile_s:g} s spent"
        return None


def run_item(args, target: Target, dtype: str, ctx) -> None:
    torch = ctx["torch"]
    timer, run, results, budget = ctx["timer"], ctx["run"], ctx["results"], ctx["budget"]
    M, N = target.M, target.N
    finish = _finish_op(results, target)
    for op in args.ops:
        # Rotate input sets past the L2; on the CPU (dry run) there is nothing to learn from rotating.
        k = 1 if args.dry_run else num_sets(bytemodel.input_set_bytes(op, M, N, bytemodel.itemsize(dtype)))
        item_recs: list[dict] = []

        def emit(impl, path, mode, res=None, error=None, timer_name=""):
            rec = make_record(op=op, mode=mode, dtype=dtype, target=target, impl=impl, path=path, run=run,
                              res=res, error=error, timer=timer_name, n_sets=k)
            item_recs.append(rec)
            if error and error.startswith("skipped"):
                return  # counted in the item's summary line
            if error:
                log(f"{op} {dtype} {target.name} {mode:10s} {impl:18s} {path:6s} ERROR {error[:160]}")
                if ctx["verbose_errors"] and not error.startswith("skipped"):
                    traceback.print_exc()
            else:
                log(f"{op} {dtype} {target.name} {mode:10s} {impl:18s} {path:6s} {rec['median_us']:10.1f} us "
                    f"{rec['tbps']:6.2f} TB/s {rec['pct_copy']:6.1f}% of copy")

        def todo(impl, path, mode) -> bool:
            key = (op, mode, dtype, target.name, impl, path)
            return key not in results.done

        def measure(impl, path, mode, fn, timer_name):
            if not todo(impl, path, mode):
                return
            why = budget.reason(impl)
            if why:
                budget.skipped += 1
                emit(impl, path, mode, error=why, timer_name=timer_name)
                return
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                emit(impl, path, mode, error=short_error(e), timer_name=timer_name)
                if ctx["device"].type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                return
            emit(impl, path, mode, res=res, timer_name=timer_name)

        impls = [("normkit", "kernel"), ("normkit", "e2e")] + [(i, "e2e") for i in ctx["torch_fns"] if i != "normkit"]
        impls += [(i, "e2e") for i in ctx["jax_fns"]]
        if not any(todo(impl, path, mode) for impl, path in impls for mode in args.modes):
            continue  # all done in the merged results
        # Out of time: record what is left as skipped without allocating anything.
        why = budget.reason("normkit")
        if why:
            for impl, path in impls:
                for mode in args.modes:
                    if todo(impl, path, mode):
                        budget.skipped += 1
                        emit(impl, path, mode, error=why)
            finish(item_recs)
            continue

        # ---- Torch side: one set of inputs shared by every implementation.
        from benchmarks import impls_torch as it

        inp = None
        try:
            inp = it.TorchInputs(op, M, N, dtype, ctx["device"], k, seed=args.seed)
            for mode in args.modes:
                measure("normkit", "kernel", mode, lambda: it.time_kernel(inp, mode, timer, ctx["device"]),
                        "do_bench" if timer.name == "gpu" else "perf_counter")
            for impl, maker in ctx["torch_fns"].items():
                compiled = None
                t_impl = time.perf_counter()
                if impl == "torch_compile":
                    if budget.reason(impl) is None and any(todo(impl, "e2e", m) for m in args.modes):
                        try:
                            compiled = it.Compiled(op, args.compile_backend)
                        except Exception as e:  # noqa: BLE001
                            for mode in args.modes:
                                emit(impl, "e2e", mode, error=short_error(e))
                            continue
                    f = compiled
                else:
                    f = None
                    try:
                        f = maker(op)
                    except Exception as e:  # noqa: BLE001
                        for mode in args.modes:
                            emit(impl, "e2e", mode, error=short_error(e))
                        continue
                for mode in args.modes:
                    measure(impl, "e2e", mode,
                            lambda: it.time_e2e(f, inp, mode, timer, ctx["device"], compiled=compiled),
                            "loop" if timer.name == "gpu" else "perf_counter")
                if impl == "torch_compile":
                    budget.compile_spent += time.perf_counter() - t_impl
                    if compiled is not None:
                        import torch._dynamo

                        torch._dynamo.reset()
        except Exception as e:  # noqa: BLE001 (e.g. out of memory allocating the inputs)
            for impl, path in impls:
                if impl in ctx["jax_fns"]:
                    continue
                for mode in args.modes:
                    if todo(impl, path, mode) and not any((r["impl"], r["path"], r["mode"]) == (impl, path, mode)
                                                          for r in item_recs):
                        emit(impl, path, mode, error=f"setup: {short_error(e)}")
        finally:
            if inp is not None:
                inp.free()
            inp = None
            gc.collect()
            if ctx["device"].type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

        # ---- JAX side.
        if ctx["jax_fns"]:
            from benchmarks import impls_jax as ij

            jinp = None
            try:
                jinp = ij.JaxInputs(op, M, N, dtype, k, seed=args.seed)
                for impl, maker in ctx["jax_fns"].items():
                    try:
                        jitted = ij.Jitted(op, maker(op))
                    except Exception as e:  # noqa: BLE001
                        for mode in args.modes:
                            emit(impl, "e2e", mode, error=short_error(e))
                        continue
                    for mode in args.modes:
                        measure(impl, "e2e", mode, lambda: ij.time_e2e(jitted, jinp, mode, timer),
                                "loop" if timer.name == "gpu" else "perf_counter")
            except Exception as e:  # noqa: BLE001 (e.g. out of memory allocating the inputs)
                for impl in ctx["jax_fns"]:
                    for mode in args.modes:
                        if todo(impl, "e2e", mode) and not any((r["impl"], r["mode"]) == (impl, mode)
                                                               for r in item_recs):
                            emit(impl, "e2e", mode, error=f"setup: {short_error(e)}")
            finally:
                # jax_frontend imports jax_triton lazily, at its first GPU launch: undo its cache-dir
                # clobber here too, before the next Torch-side Triton compile.
                _restore_cache_dir(ctx["saved_cache_dir"])
                if jinp is not None:
                    jinp.free()
                jinp = None
                gc.collect()
                try:
                    import jax

                    jax.clear_caches()
                except Exception:  # noqa: BLE001
                    pass

        finish(item_recs)


def _finish_op(results, target: Target):
    def finish(item_recs: list[dict]) -> None:
        skipped = [r for r in item_recs if (r["error"] or "").startswith("skipped")]
        if skipped:
            log(f"   {len(skipped)} measurements of {skipped[0]['op']} {skipped[0]['dtype']} {skipped[0]['shape']} "
                f"{skipped[0]['error']}")
        for rec in item_recs:
            results.add(rec)
            for alias in target.aliases:
                results.add({**rec, "shape": alias, "measured_as": target.name})
    return finish


def add_speedups(recs: list[dict]) -> None:
    """On normkit's e2e records of one (op, mode, dtype, shape): each other implementation's e2e median
    over normkit's (> 1: normkit is faster)."""
    ok = {r["impl"]: r for r in recs if r["path"] == "e2e" and r["median_us"]}
    for impl in ("normkit", "normkit_jax"):
        if impl in ok:
            ok[impl]["speedup_vs"] = {peer: _sig(pr["median_us"] / ok[impl]["median_us"], 4)
                                      for peer, pr in sorted(ok.items()) if peer != impl} or None


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    saved_cache_dir = os.environ.get("TRITON_CACHE_DIR")
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
    status, torch_fns, jax_fns = load_peers(args, saved_cache_dir)
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
    budget = Budget(args.budget_s, args.compile_budget_s)
    budget.t0 = t_start
    ctx = {"torch": torch, "device": device, "timer": timer, "run": run, "results": results, "budget": budget,
           "torch_fns": torch_fns, "jax_fns": jax_fns, "saved_cache_dir": saved_cache_dir,
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
