"""Host time of the same Torch calls from two or more checkouts of normkit, run alternately on one machine.

Host time moves by tens of percent between runs on the same machine (docs/PERFORMANCE_RECORD.md,
"Torch host time"), so two versions of the Torch frontend are only comparable when measured in the
same run, alternately, each beside ATen's eager norm in the same process. This script does that:
``--tree NAME=PATH`` names a checkout (a directory holding ``normkit/`` and ``torch_frontend/``;
``git archive <commit> normkit torch_frontend | tar -x -C <dir>`` makes one); each round runs every
tree once, in a fresh process with that tree first on ``sys.path``, each round starting one tree later
than the one before. A process times, through autograd as a user calls it, at 4096x1024 bf16 (about
5 µs of GPU work per kernel, so the host sets the time), RMSNorm, LayerNorm and the fused add with
frozen parameters:

- ``fwd``: the forward with x requiring grad (what a training step's forward pays);
- ``fwd+bwd``: the forward and ``torch.autograd.grad`` of its outputs w.r.t. x (and the residual);
- ``infer``: the forward under ``torch.no_grad()``;

and the same calls of ``torch.nn.functional.rms_norm`` / ``layer_norm`` (the fused add: ``x + r``
then ``rms_norm``), labelled ``eager``. Each figure is ``benchmarks.timing.Timer.loop``'s: the median
over blocks of back-to-back calls, each block synchronized once at its end, in µs per call. A row gives
the median over rounds of normkit's time, of eager's, and of their per-process ratio.

GPU machine, from the repository root::

    git archive 8e63874 normkit torch_frontend | (mkdir -p build/ab_old && tar -x -C build/ab_old)
    python3 benchmarks/host_ab.py --tree before=build/ab_old --tree after=. --rounds 3 --out "$OUT"

On a CPU (``--dry-run``: 64x256 fp32 in Triton's interpreter, one call per figure) it only exercises
the code.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CASES = [(op, kind) for op in ("rms_norm", "layer_norm", "fused_add_rms_norm") for kind in ("fwd", "fwd+bwd", "infer")]


def _calls(tf, F, torch, op: str, kind: str, x, r, w, b, dy):
    """(normkit's call, eager's call) for one case; each takes no argument and returns its last output."""
    n = x.shape[-1]
    ops = {
        "rms_norm": (lambda: (tf.rms_norm(x, w, 1e-6),), lambda: (F.rms_norm(x, (n,), w, 1e-6),), (x,)),
        "layer_norm": (lambda: (tf.layer_norm(x, w, b, 1e-6),), lambda: (F.layer_norm(x, (n,), w, b, 1e-6),), (x,)),
        "fused_add_rms_norm": (lambda: tuple(tf.fused_add_rms_norm(x, r, w, 1e-6)),
                               lambda: (lambda s: (F.rms_norm(s, (n,), w, 1e-6), s))(x + r), (x, r)),
    }
    ours, eager, inputs = ops[op]

    def wrap(fwd):
        if kind == "fwd":
            return lambda: fwd()[0]
        if kind == "infer":
            def infer():
                with torch.no_grad():
                    return fwd()[0]
            return infer

        def step():
            outs = fwd()
            return torch.autograd.grad(outs, inputs, [dy] * len(outs))[0]
        return step

    return wrap(ours), wrap(eager)


def worker(dry: bool) -> dict:
    """Time every case in this process (the tree to measure is first on sys.path)."""
    import torch
    import torch.nn.functional as F

    import torch_frontend as tf
    from benchmarks.timing import Timer, torch_sync

    device, dtype, shape = ("cpu", torch.float32, (64, 256)) if dry else ("cuda", torch.bfloat16, (4096, 1024))
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    x, r, dy = rand(*shape).requires_grad_(), rand(*shape).requires_grad_(), rand(*shape)
    w, b = rand(shape[1]) * 0.1 + 1, rand(shape[1]) * 0.1
    timer = Timer(dry=True) if dry else Timer(warmup_ms=100, rep_ms=400, batches=7)
    out = {"normkit_file": tf.__file__}
    for op, kind in CASES:
        ours, eager = _calls(tf, F, torch, op, kind, x, r, w, b, dy)
        for name, fn in (("normkit", ours), ("eager", eager)):
            fn()  # compile / first-call work outside the timing
            out[f"{op} {kind} {name}"] = timer.loop(lambda _i, fn=fn: fn(), torch_sync)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (repeat)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for host_ab.json and host_ab.md")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny fp32 shapes, one call per figure")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.dry_run)))
        return 0
    trees = dict(t.split("=", 1) for t in a.tree)
    if len(trees) < 2:
        p.error("name at least two trees: --tree before=PATH --tree after=PATH")
    for name, path in trees.items():
        if not (Path(path) / "torch_frontend").is_dir():
            p.error(f"--tree {name}={path}: no torch_frontend/ there")
    names = list(trees)
    runs = {name: [] for name in names}
    for rnd in range(a.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            path = str(Path(trees[name]).resolve())
            code = ("import sys; sys.path[:0] = [%r, %r]; from benchmarks.host_ab import main; "
                    "sys.exit(main(sys.argv[1:]))" % (path, str(REPO)))
            cmd = [sys.executable, "-c", code, "--worker"] + (["--dry-run"] if a.dry_run else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if proc.returncode:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"host_ab: tree {name} failed in round {rnd}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            if not res["normkit_file"].startswith(path):
                raise SystemExit(f"host_ab: tree {name} imported {res['normkit_file']}, not its own copy")
            runs[name].append(res)
            print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items() if k.endswith("normkit")),
                  flush=True)
    rows = []
    for op, kind in CASES:
        for name in names:
            ours = [r[f"{op} {kind} normkit"] for r in runs[name]]
            eager = [r[f"{op} {kind} eager"] for r in runs[name]]
            rows.append({"op": op, "call": kind, "tree": name, "normkit_us": statistics.median(ours),
                         "eager_us": statistics.median(eager),
                         "ratio": statistics.median(o / e for o, e in zip(ours, eager))})
    from benchmarks.env import versions

    result = {"trees": trees, "rounds": a.rounds, "dry_run": a.dry_run, "versions": versions(), "rows": rows,
              "runs": runs}
    lines = ["| op | call | tree | normkit µs | eager µs | normkit ÷ eager |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['call']} | {r['tree']} | {r['normkit_us']:.1f} | {r['eager_us']:.1f} | {r['ratio']:.2f} |"
              for r in rows]
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_ab.json").write_text(json.dumps(result, indent=1))
        (out / "host_ab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
