"""Device time of the JAX implementations, split from the per-call host and dispatch time.

Each (op, mode, dtype, shape, impl) call is built exactly as ``benchmarks/impls_jax.py`` builds it for
bench.py's e2e records (``impls_jax.mode_call``: the same jit, the same separately jitted vjp,
the same input rotation). Impls: ``triton`` (jax_frontend auto, which must resolve to Triton),
``pallas``, ``xla`` (jax_frontend's ``implementation=``) and ``jnp`` (bench.py's ``xla`` peer: a jnp
expression under JAX's autodiff). Per row:

- ``wall``: the median per-call wall time of back-to-back calls, one sync per block
  (``benchmarks.timing.Timer.loop``, bench.py's e2e timer);
- a ``jax.profiler`` trace of ``--calls`` back-to-back calls, read with ``ProfileData``: the events on
  the per-stream lines ("Stream ...") of the ``/device:GPU:n`` planes (kernels, memcpys, memsets; the
  other lines are derived views, see ``is_stream_line``). ``busy`` = sum of their durations / calls,
  ``span`` = first start to last end / calls, ``union`` = busy with overlapping streams counted once,
  events per call, and each kernel's median duration and count per call;
- bandwidth under ``bytemodel.py`` from busy (and from wall), as % of the device-to-device copy of
  ``benchmarks.timing.Timer.copy_bandwidth`` (read + write), measured in the same run.

wall >> busy: the call costs host or dispatch time; span >> busy: the device waits between kernels.
The lines seen and kept are printed, so a first run shows whether the stream rule holds.

    python3 benchmarks/device_time.py [--ops rms_norm] [--modes fwd] [--impls triton,pallas] \\
        [--shapes 8192x8192] [--calls 20] [--out device_time.json]
    python3 benchmarks/device_time.py --dry-run
    bash scripts/gpu-check.sh device-time [same flags]     # on the GPU machine: $OUT/device_time.{json,log}

On CPU, or with ``--dry-run`` (which forces JAX onto the CPU): a 24x256 shape, 2 calls, and the
"device" events are XLA's CPU thunks on the ``/host:CPU`` plane (events with an ``hlo_op`` stat);
the copy is a host copy.
It proves the code path end to end and says nothing about speed.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks import bytemodel  # noqa: E402
from benchmarks.env import short_error, versions  # noqa: E402
from benchmarks.report import markdown_table  # noqa: E402
from benchmarks.timing import Timer, num_sets, tbps  # noqa: E402
from normkit.shapes import parse_list  # noqa: E402

OPS = bytemodel.OPS
MODES = tuple(m for m in bytemodel.MODES if m != "fwd_bwd")
DTYPES = {**{short: short for short in bytemodel.DTYPES}, **{name: short for short, name in bytemodel.DTYPES.items()}}
# name -> (bench.py's impl name, jax_frontend's implementation=; None: not jax_frontend)
IMPLS = {"triton": ("normkit_jax", "triton"), "pallas": ("normkit_jax_pallas", "pallas"),
         "xla": ("normkit_jax_xla", "xla"), "jnp": ("xla", None)}
DEFAULT_SHAPES = "8192x8192,16384x8192,32768x4096"
DRY_SHAPES, DRY_CALLS, CALLS = "24x256", 2, 20
WARMUP_MS, REP_MS = 5.0, 25.0


# ---------------------------------------------------------------------------------------------
# Trace events: which count as device work, and what they add up to (pure functions).

Event = collections.namedtuple("Event", "name start_ns duration_ns stats")  # stats: a dict


def is_stream_line(line_name: str) -> bool:
    """On a GPU plane, the lines that hold the device's own events are one per CUDA stream
    ("Stream #13(...)": kernels, memcpys, memsets, as CUPTI reports them). Every other line
    ("XLA Modules", "XLA Ops", "Steps", ...) is a view derived from those, and counting it would count
    the same time twice."""
    return line_name.startswith("Stream")


def is_gpu_plane(plane_name: str) -> bool:
    return plane_name.startswith("/device:GPU:")


def select_events(planes: dict, source: str) -> tuple[list[Event], list[dict]]:
    """The device events of a trace, and a listing of the lines looked at.

    ``planes``: {plane name: {line name: [Event, ...]}}. ``source="gpu"``: every event on the stream
    lines of the GPU planes. ``source="host"`` (CPU backend): the events with an ``hlo_op`` stat on
    ``/host:CPU``, XLA's thunks (nested thunks, e.g. a while loop's body, are counted with their
    parent: on CPU the sum means nothing). The listing: one {plane, line, events, kept} per line of the
    planes looked at, and one with line None for each other plane."""
    if source not in ("gpu", "host"):
        raise ValueError(f"source must be 'gpu' or 'host', not {source!r}")
    events, listing = [], []
    for plane, lines in planes.items():
        if not (is_gpu_plane(plane) if source == "gpu" else plane == "/host:CPU"):
            listing.append({"plane": plane, "line": None, "events": sum(map(len, lines.values())), "kept": 0})
            continue
        for line, evs in lines.items():
            if source == "gpu":
                kept = list(evs) if is_stream_line(line) else []
            else:
                kept = [e for e in evs if "hlo_op" in e.stats]
            events += kept
            listing.append({"plane": plane, "line": line, "events": len(evs), "kept": len(kept)})
    return events, listing


def _union_ns(events: list[Event]) -> float:
    """Time during which at least one event ran (overlapping streams counted once)."""
    total, end = 0.0, None
    for s, d in sorted((e.start_ns, e.duration_ns) for e in events):
        if end is None or s >= end:
            total, end = total + d, s + d
        elif s + d > end:
            total, end = total + (s + d - end), s + d
    return total


def summarize(events: list[Event], calls: int) -> dict:
    """Per-call figures of the events of ``calls`` traced calls: events per call, device busy
    (sum of durations), span (first start to last end), union (busy with overlaps counted once),
    and the distinct kernels (by name and hlo_op), longest total first."""
    if calls <= 0:
        raise ValueError("calls must be positive")
    if not events:
        return {"events_per_call": 0.0, "device_busy_us": 0.0, "device_span_us": 0.0, "device_union_us": 0.0,
                "memcpy_us": 0.0, "kernels": []}
    groups: dict[tuple, list[float]] = collections.defaultdict(list)
    for e in events:
        groups[e.name, e.stats.get("hlo_op")].append(e.duration_ns)
    kernels = [{"name": name, "hlo_op": None if hlo_op is None else str(hlo_op),
                "median_us": statistics.median(d) / 1e3, "per_call": len(d) / calls, "total_us": sum(d) / 1e3}
               for (name, hlo_op), d in groups.items()]
    kernels.sort(key=lambda k: -k["total_us"])
    start = min(e.start_ns for e in events)
    end = max(e.start_ns + e.duration_ns for e in events)
    return {"events_per_call": len(events) / calls,
            "device_busy_us": sum(e.duration_ns for e in events) / calls / 1e3,
            "device_span_us": (end - start) / calls / 1e3,
            "device_union_us": _union_ns(events) / calls / 1e3,
            "memcpy_us": sum(e.duration_ns for e in events if is_memcpy(e.name)) / calls / 1e3,
            "kernels": kernels}


def is_memcpy(name: str) -> bool:
    """A copy event (CUPTI's "MemcpyD2D", XLA's "memcpy128"...), not a compute kernel. Runs before
    ``impls_jax._one_residual_grad`` show one per fused-op backward: its jit returned d_residual and
    dx, one array, as two outputs, and XLA copied it; inside a larger jit there is no such copy."""
    return name.lower().startswith("memcpy")


# ---------------------------------------------------------------------------------------------
# Tracing.


def planes_of(profile) -> dict:
    """A ``jax.profiler.ProfileData`` as {plane name: {line name: [Event, ...]}}."""
    out: dict = {}
    for plane in profile.planes:
        lines = out.setdefault(plane.name, {})
        for line in plane.lines:
            lines.setdefault(line.name, []).extend(
                Event(ev.name, float(ev.start_ns), float(ev.duration_ns), dict(ev.stats)) for ev in line.events)
    return out


def trace(call, calls: int, source: str) -> tuple[list[Event], list[dict]]:
    """``calls`` back-to-back ``call(i)`` and one sync, inside ``jax.profiler.trace``; the device events."""
    import jax
    from jax.profiler import ProfileData, ProfileOptions

    options = ProfileOptions()
    options.python_tracer_level = 0  # no Python function events: they would slow the dispatch down
    d = tempfile.mkdtemp(prefix="normkit-device-time-")
    try:
        with jax.profiler.trace(d, profiler_options=options):
            out = None
            for i in range(calls):
                out = call(i)
            jax.block_until_ready(out)
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if len(files) != 1:
            raise RuntimeError(f"expected one .xplane.pb under the trace directory, found {files}")
        planes = planes_of(ProfileData.from_file(files[0]))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    events, listing = select_events(planes, source)
    if not events:
        raise RuntimeError(f"no device events in the trace ({source} rule); planes and lines: " + "; ".join(
            f"{plane} | {line!r} ({len(evs)} events)"
            for plane, lines in planes.items() for line, evs in lines.items()))
    return events, listing


class Lines:
    """Prints each trace line the first time it is seen, with whether its events were kept."""

    def __init__(self):
        self.seen: dict[tuple, dict] = {}

    def show(self, listing: list[dict]) -> None:
        for ln in listing:
            key = (ln["plane"], ln["line"])
            if key in self.seen:
                self.seen[key]["kept"] |= bool(ln["kept"])
                continue
            self.seen[key] = {"plane": ln["plane"], "line": ln["line"], "kept": bool(ln["kept"])}
            if ln["line"] is None:
                print(f"  trace plane {ln['plane']}: not looked at ({ln['events']} events)", flush=True)
                continue
            verdict = f"kept ({ln['kept']} of {ln['events']} events)" if ln["kept"] else \
                f"not counted ({ln['events']} events)"
            print(f"  trace line {ln['plane']} | {ln['line']!r}: {verdict}", flush=True)


def measure(call, *, calls: int, source: str, timer: Timer, lines: Lines) -> dict:
    """Compile and warm ``call``, time it by the loop, then trace it."""
    import jax

    sync = jax.block_until_ready
    t0 = time.perf_counter()
    sync(call(0))
    compile_s = time.perf_counter() - t0
    wall = timer.loop(call, sync)
    events, listing = trace(call, calls, source)
    lines.show(listing)
    res = summarize(events, calls)
    return {"wall_us": wall, "compile_s": round(compile_s, 3), **res,
            "lines_kept": sorted({f"{ln['plane']} | {ln['line']}" for ln in listing if ln["kept"]})}


# ---------------------------------------------------------------------------------------------
# The run.


def _list(value: str, allowed, aliases=None) -> list[str]:
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        item = (aliases or {}).get(item, item)
        if item not in allowed:
            raise SystemExit(f"device_time: unknown value {item!r}; expected one of {', '.join(allowed)}")
        out.append(item)
    return out


def impl_fn(impl: str, op: str):
    """The function of ``impl`` for ``op`` as bench.py builds it; raises why it cannot run here."""
    from benchmarks import impls_jax as ij

    bench_name, implementation = IMPLS[impl]
    if implementation is None:
        return ij.xla_fn(op), "jnp"
    import jax_frontend as jf

    resolved = jf.resolve_implementation(implementation)  # raises when it cannot run here
    if impl == "triton" and jf.resolve_implementation(None) != "triton":  # bench.py's normkit_jax is auto
        raise RuntimeError(f"auto resolves to {jf.resolve_implementation(None)!r}, not triton")
    return ij.NORMKIT_JAX_FNS[bench_name](op), resolved


HEADER = (f"{'op':<18} {'mode':<10} {'dtype':<5} {'shape':<11} {'impl':<6} {'wall us':>9} {'busy us':>9} "
          f"{'span us':>9} {'ev/call':>7} {'%copy dev':>9} {'%copy wall':>10}")


def row_line(r: dict) -> str:
    head = f"{r['op']:<18} {r['mode']:<10} {r['dtype']:<5} {r['shape']:<11} {r['impl']:<6}"
    if r.get("error"):
        return f"{head} {r['error']}"
    pct = "".join(f" {'-' if v is None else f'{v:.1f}':>{w}}" for v, w in
                  ((r["pct_copy_device"], 9), (r["pct_copy_wall"], 10)))
    return (f"{head} {r['wall_us']:9.1f} {r['device_busy_us']:9.1f} {r['device_span_us']:9.1f} "
            f"{r['events_per_call']:7.2f}{pct}")


def kernel_lines(kernels: list[dict], top: int = 6) -> list[str]:
    out = [f"    {k['per_call']:5.2f}/call {k['median_us']:9.1f} us  {k['name'][:90]}"
           + (f"  [{k['hlo_op']}]" if k["hlo_op"] and k["hlo_op"] != k["name"] else "") for k in kernels[:top]]
    if len(kernels) > top:
        out.append(f"    ... {len(kernels) - top} more (see the JSON)")
    return out


def _cell(r: dict | None) -> str:
    if r is None or r.get("error") or not r.get("wall_us"):
        return "—"
    cell = f"{r['wall_us']:.1f} / {r['device_busy_us']:.1f}"
    if r.get("pct_copy_device") is not None:
        cell += f" ({r['pct_copy_device']:.0f}%)"
    return cell


def _kernel_pct(r: dict, copy_tbps: float) -> float:
    """% of copy of the row's compute kernels alone (its memcpy events left out)."""
    us = r["device_busy_us"] - sum(k["total_us"] for k in r["kernels"] if is_memcpy(k["name"])) / r["calls"]
    return 100 * tbps(r["bytes"], us) / copy_tbps


def _copy_tbps(run: dict) -> float | None:
    """The run's copy bandwidth (result files of the traced XLA copy name it ``tbps_device``)."""
    return run["copy"].get("tbps") or run["copy"].get("tbps_device")


def _targets(run: dict) -> list[dict]:
    """The Pallas rows of one run at M·N >= 64M against their targets: forward and frozen backward at
    >= 85% of copy (kernel time, memcpy events left out); full backward >= 1.5x faster than each XLA row."""
    copy_tbps = _copy_tbps(run)
    by = {(r["op"], r["mode"], r["dtype"], r["shape"], r["impl"]): r for r in run["records"] if not r.get("error")}
    rows = []
    for (op, mode, dtype, shape, impl), r in by.items():
        if impl != "pallas" or r["M"] * r["N"] < 64 * 2**20 or not copy_tbps:
            continue
        case = {"op": op, "mode": mode, "case": f"{dtype} {shape}"}
        if mode in ("fwd", "bwd_frozen"):
            pct = _kernel_pct(r, copy_tbps)
            rows.append({**case, "measured": f"{pct:.1f}% of copy", "target": f"{'met' if pct >= 85 else 'missed'} (≥ 85%)"})
            continue
        peers = [(peer, r2) for peer in ("xla", "jnp") if (r2 := by.get((op, mode, dtype, shape, peer)))]
        if peers:  # else: no XLA row in this run to compare with
            met = all(r2["wall_us"] / r["wall_us"] >= 1.5 for _, r2 in peers)
            rows.append({**case, "measured": ", ".join(f"{r2['wall_us'] / r['wall_us']:.2f}× vs {peer}" for peer, r2 in peers),
                         "target": f"{'met' if met else 'missed'} (≥ 1.5×)"})
    return rows


def report(results: list[dict]) -> str:
    """Markdown of one or more runs' JSON: per dtype and shape, each op and mode, each impl's
    ``wall / busy µs (busy as % of copy)``; then the Pallas rows against their targets."""
    out = ["# Device time of the JAX implementations (`benchmarks/device_time.py`)", ""]
    devices = sorted({r["device"] for r in results})
    copies = [f"{_copy_tbps(r):.2f} TB/s, {r['copy'].get('what', 'a device copy')}" for r in results if _copy_tbps(r)]
    out.append(f"{', '.join(devices)}; versions {results[0]['versions']}. Each cell: per-call **wall** µs "
               "(back-to-back calls, one sync per block: what a caller waits) / device **busy** µs (the sum of "
               "the GPU events of a traced call) and, in brackets, busy as % of a copy's bandwidth measured in the "
               f"same run ({'; '.join(copies)}). Bytes from `benchmarks/bytemodel.py`. "
               "A fused-op backward whose jit returns one array as both dx and d_residual pays one memcpy of an "
               "[M, N] array per call; the targets below leave memcpy events out (`is_memcpy`).")
    rows = [r for res in results for r in res["records"]]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    groups: dict = collections.defaultdict(dict)
    for r in rows:
        groups[r["dtype"], r["shape"]][r["op"], r["mode"], r["impl"]] = r
    for (dtype, shape), table in groups.items():
        cells = [{"op": op, "mode": mode, **{i: _cell(table.get((op, mode, i))) for i in impls}}
                 for op in OPS for mode in MODES if any((op, mode, i) in table for i in impls)]
        out += ["", f"## {dtype} {shape}", "", markdown_table(cells)]
    targets = [row for res in results for row in _targets(res)]
    if targets:
        out += ["", "## Pallas against its targets (M·N ≥ 64M)", "",
                "Forward and frozen backward: the Pallas kernels' busy time (memcpy events left out) as % of "
                "copy. Full backward: wall time of `xla` (normkit's custom_vjp over jnp) and of `jnp` (JAX's own "
                "autodiff) over Pallas's.", "", markdown_table(targets)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", metavar="JSON", help="print the Markdown report of these runs' JSON and exit")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dtypes", default="bf16", help="bf16,fp32")
    p.add_argument("--shapes", default=None, help=f"MxN,... (default {DEFAULT_SHAPES}; dry run {DRY_SHAPES})")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"of {','.join(IMPLS)}")
    p.add_argument("--calls", type=int, default=None,
                   help=f"traced calls per row (default {CALLS}; dry run {DRY_CALLS})")
    p.add_argument("--rep-ms", type=float, default=REP_MS, help="wall-time loop: milliseconds over 5 blocks")
    p.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    p.add_argument("--dry-run", action="store_true", help="JAX on the CPU, a tiny shape, 2 calls: the code path only")
    args = p.parse_args(argv)
    if args.report:
        print(report([json.loads(Path(f).read_text()) for f in args.report]), end="")
        return 0
    ops, modes = _list(args.ops, OPS), _list(args.modes, MODES)
    dtypes, impls = _list(args.dtypes, tuple(DTYPES), DTYPES), _list(args.impls, tuple(IMPLS))
    dtypes = [DTYPES[d] for d in dtypes]

    import jax

    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    dry = args.dry_run or jax.default_backend() == "cpu"
    source = "host" if jax.default_backend() == "cpu" else "gpu"
    calls = args.calls or (DRY_CALLS if dry else CALLS)
    shapes = parse_list(args.shapes or (DRY_SHAPES if dry else DEFAULT_SHAPES))
    device = jax.devices()[0]
    print(f"device_time: backend {jax.default_backend()}, device {device.device_kind}, {calls} traced calls per row, "
          f"events from {'the GPU planes, stream lines only' if source == 'gpu' else '/host:CPU, hlo_op thunks'}",
          flush=True)
    if dry:
        print("device_time: DRY RUN on the CPU: proves the code path end to end; the numbers say nothing about speed",
              flush=True)

    from benchmarks import impls_jax as ij

    lines = Lines()
    timer = Timer(dry=True) if dry else Timer(WARMUP_MS, args.rep_ms)
    kw = {"calls": calls, "source": source, "timer": timer, "lines": lines}
    try:
        copy = timer.copy_bandwidth()
        print(f"copy: {copy['what']}: {copy['median_us']:.1f} us, {copy['tbps']:.2f} TB/s", flush=True)
    except Exception as e:  # noqa: BLE001 (the rows still run; their % of copy is null)
        copy = {"error": short_error(e), "tbps": None}
        print(f"copy: ERROR {copy['error']}", flush=True)
    copy_tbps = copy["tbps"]
    result = {"schema": "normkit-device-time/1", "argv": sys.argv[1:] if argv is None else list(argv),
              "dry_run": dry, "backend": jax.default_backend(), "device": device.device_kind,
              "versions": versions(), "calls": calls, "event_source": source,
              "copy": copy, "lines": [], "records": []}

    def write():
        if args.out:
            result["lines"] = list(lines.seen.values())
            Path(args.out).write_text(json.dumps(result, indent=1))

    print(HEADER, flush=True)
    failed = 0
    for M, N in shapes:
        for dtype in dtypes:
            for op in ops:
                itemsize = bytemodel.itemsize(dtype)
                k = 1 if dry else num_sets(bytemodel.input_set_bytes(op, M, N, itemsize))
                nbytes = {mode: bytemodel.bytes_moved(op, mode, M, N, itemsize) for mode in modes}
                inp, setup_error = None, None
                try:
                    inp = ij.JaxInputs(op, M, N, dtype, k)
                except Exception as e:  # noqa: BLE001 (e.g. out of memory): an error on each row
                    setup_error = f"setup: {short_error(e)}"
                for impl in impls:
                    base = {"op": op, "dtype": dtype, "shape": f"{M}x{N}", "M": M, "N": N, "impl": impl,
                            "bench_impl": IMPLS[impl][0], "n_sets": k, "calls": calls}
                    why_not, resolved = setup_error, None
                    if why_not is None:
                        try:
                            f, resolved = impl_fn(impl, op)
                            jitted = ij.Jitted(op, f)
                        except Exception as e:  # noqa: BLE001 (cannot run here: skipped, with the reason)
                            why_not = f"skipped: {short_error(e)}"
                    for mode in modes:
                        rec = {**base, "mode": mode, "implementation": resolved, "bytes": nbytes[mode]}
                        if why_not:
                            rec["error"] = why_not
                        else:
                            try:
                                call, _ = ij.mode_call(jitted, inp, mode)
                                res = measure(call, **kw)
                                # both against the copy's device bandwidth: they differ by busy / wall only
                                tbps_dev = tbps(nbytes[mode], res["device_busy_us"])
                                tbps_wall = tbps(nbytes[mode], res["wall_us"])
                                rec.update(res, error=None, tbps_device=tbps_dev, tbps_wall=tbps_wall,
                                           pct_copy_device=copy_tbps and 100 * tbps_dev / copy_tbps,
                                           pct_copy_wall=copy_tbps and 100 * tbps_wall / copy_tbps)
                                del call
                            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                                rec["error"] = short_error(e)
                        failed += bool(rec["error"]) and not rec["error"].startswith("skipped")
                        result["records"].append(rec)
                        print(row_line(rec), flush=True)
                        if not rec["error"]:
                            print("\n".join(kernel_lines(rec["kernels"])), flush=True)
                        write()
                if inp is not None:
                    inp.free()
                inp = None
    write()
    print(f"device_time: {len(result['records'])} rows, {failed} failed"
          + (f"; JSON in {args.out}" if args.out else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
