"""One Triton kernel, two launchers: the Torch frontend's and jax-triton's, compared on a GPU.

For one op and mode, the script launches the shared Triton kernel through ``torch_frontend`` and
through ``jax_frontend`` (``implementation="triton"``) on the same shape, and prints side by side:

- the launch records (grid, warps, stages, every constexpr);
- the compiled kernel each launcher made: the TTIR function signature (argument attributes such as
  ``tt.divisibility``), the PTX's global load/store widths, and the compile metadata (shared memory,
  registers where Triton reports them);
- the device time per call of back-to-back launches (CUDA events around the Torch calls; a
  ``jax.profiler`` trace for the JAX calls, read as ``benchmarks/device_time.py`` reads it).

Torch's kernels come from a fresh ``TRITON_CACHE_DIR``; jax-triton's from ``JAX_TRITON_DUMP_DIR``.
GPU only.

    python3 scripts/triton_paths.py --op rms_norm --mode fwd --shape 8192x8192
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

TMP = tempfile.mkdtemp(prefix="triton_paths_")
os.environ["TRITON_CACHE_DIR"] = os.path.join(TMP, "torch_cache")
os.environ["JAX_TRITON_DUMP_DIR"] = os.path.join(TMP, "jax_dump")
os.makedirs(os.environ["JAX_TRITON_DUMP_DIR"])

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.pallas_ptx import summary  # noqa: E402  (PTX global load/store widths)


def signature(ttir: str) -> str:
    m = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", ttir, re.S)
    return re.sub(r"\s+", " ", m.group(1)) if m else "(signature not found)"


def describe(tag: str, ttir: str, ptx: str, meta: dict) -> None:
    s = summary(ptx)
    regs = re.findall(r"\.maxnreg\s+(\d+)|\.reqntid\s+([\d, ]+)", ptx)
    print(f"  [{tag}] {s['instructions']} PTX instructions, bar.sync {s['bar.sync']}, shfl {s['shfl']}; meta {meta}; {regs}")
    for kind, count in s["global"].items():
        print(f"      {kind:24s} x {count}")
    print(f"      args: {signature(ttir)}")


def kernels_in(root: str, ext: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(f"{root}/**/*.{ext}", recursive=True)):
        found.setdefault(Path(path).stem, []).append(path)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="rms_norm")
    p.add_argument("--mode", default="fwd", choices=("fwd", "bwd_full", "bwd_frozen"))
    p.add_argument("--shape", default="8192x8192")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    M, N = map(int, args.shape.split("x"))

    import torch

    if not torch.cuda.is_available():
        print("triton_paths: needs a CUDA GPU (it compares two GPU launchers of one kernel)", file=sys.stderr)
        return 2

    import normkit
    import torch_frontend as tf

    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    r = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    trained = args.mode == "bwd_full"

    def torch_call():
        xs = x.requires_grad_(args.mode != "fwd")
        ws = w.requires_grad_(trained)
        if args.op == "rms_norm":
            y = tf.rms_norm(xs, ws)
        elif args.op == "layer_norm":
            y = tf.layer_norm(xs, ws, b.requires_grad_(trained))
        else:
            y = tf.fused_add_rms_norm(xs, r, ws)[0]
        if args.mode == "fwd":
            return y
        wrt = [xs] + ([ws] if trained else [])
        return torch.autograd.grad(y, wrt, dy)

    ctx = torch.no_grad() if args.mode == "fwd" else torch.enable_grad()
    with ctx:
        torch_call()
        with normkit.record_launches() as log:
            torch_call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.calls):
            torch_call()
        end.record()
        torch.cuda.synchronize()
    print(f"{args.op} {args.mode} bf16 {M}x{N}")
    print(f"torch: {start.elapsed_time(end) * 1e3 / args.calls:.1f} us per call, back to back (whole call, events)")
    for launch in log:
        print(f"  launch {launch.kernel} grid {launch.grid} warps {launch.num_warps} flags {launch.flags}")
    for name, paths in kernels_in(os.environ["TRITON_CACHE_DIR"], "ptx").items():
        for path in paths:
            stem = path[:-4]
            meta = json.load(open(stem + ".json")) if os.path.exists(stem + ".json") else {}
            keep = {k: meta.get(k) for k in ("num_warps", "num_stages", "shared", "maxnreg", "n_regs") if k in meta}
            describe(f"torch {name}", open(stem + ".ttir").read() if os.path.exists(stem + ".ttir") else "",
                     open(path).read(), keep)

    import jax

    from benchmarks import device_time
    from benchmarks import impls_jax as ij

    # the JAX call exactly as the JAX benchmark makes it (its inputs, jit, vjp split and freezing)
    inp = ij.JaxInputs(args.op, M, N, "bf16", 1)
    call, _ = ij.mode_call(ij.Jitted(args.op, ij.normkit_jax_fn(args.op, "triton")), inp, args.mode)
    run = lambda: call(0)  # noqa: E731
    with normkit.record_launches() as jlog:
        jax.block_until_ready(run())
    events, _ = device_time.trace(lambda i: run(), args.calls, "gpu")
    res = device_time.summarize(events, args.calls)
    print(f"jax-triton: device busy {res['device_busy_us']:.1f} us, span {res['device_span_us']:.1f} us per call; "
          + ", ".join(f"{k['name']} {k['median_us']:.1f} us" for k in res["kernels"]))
    for launch in jlog:
        print(f"  launch {launch.kernel} grid {launch.grid} warps {launch.num_warps} flags {launch.flags}")
    for name, paths in kernels_in(os.environ["JAX_TRITON_DUMP_DIR"], "ptx").items():
        for path in paths:
            stem = path[:-4]
            info = open(Path(path).parent / (name + ".compile_info")).read().strip() \
                if (Path(path).parent / (name + ".compile_info")).exists() else ""
            describe(f"jax-triton {name}", open(stem + ".ttir").read() if os.path.exists(stem + ".ttir") else "",
                     open(path).read(), {"info": info})
            config = Path(path).parent / "config"
            if config.exists():
                print("      config: " + re.sub(r"\s+", " ", config.read_text())[:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
