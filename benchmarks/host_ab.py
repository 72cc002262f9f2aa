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

``--same-process`` measures every tree in one process instead: each tree's ``normkit`` and
``torch_frontend`` are copied (under ``build/``) with their packages and torch.library namespace
renamed (``nk_<i>``, ``tf_<i>``), so that all of them import side by side; then, per case, ``--blocks``
blocks of ``--block-calls`` back-to-back calls run every tree and eager in turn (each block starting
one later), each block timed alone and synchronized at its end. A row gives the median block time of
the tree and of eager, the median of the per-block ratio to eager, and that of the per-block ratio to
the first tree (``vs_first``). The machine's drift, which moves host time by tens of percent between
processes and within one over seconds, then lands on every tree alike::

    python3 benchmarks/host_ab.py --same-process --tree before=build/ab_old --tree after=. --out "$OUT"

``--rope`` adds ``rms_norm_rope`` on a Qwen3 attention's q (the [B, H, S, D] view of a [2, 4096, 16,
128] bf16 projection, HF's tables, a frozen weight) against HF's two functions eager (``Qwen3RMSNorm``'s
``rms_norm``, then the rotation), for trees that have it.

On a CPU (``--dry-run``: 64x256 fp32 in Triton's interpreter, one call per figure, or per block) it
only exercises the code.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import time
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
KINDS = ("fwd", "fwd+bwd", "infer")
CASES = [(op, kind) for op in ("rms_norm", "layer_norm", "fused_add_rms_norm") for kind in KINDS]
# --rope: rms_norm_rope on a Qwen3 attention's q (its [B, H, S, D] view), against HF's two functions eager
ROPE_CASES = [("rms_norm_rope", kind) for kind in KINDS]


def _calls(tf, F, torch, op: str, kind: str, x, r, w, b, dy, rope_in=None):
    """(normkit's call, eager's call) for one case; each takes no argument and returns its last output.
    ``rope_in``: ``(q, w, cos, sin, dq)`` for ``rms_norm_rope``."""
    n = x.shape[-1]
    ops = {
        "rms_norm": (lambda: (tf.rms_norm(x, w, 1e-6),), lambda: (F.rms_norm(x, (n,), w, 1e-6),), (x,)),
        "layer_norm": (lambda: (tf.layer_norm(x, w, b, 1e-6),), lambda: (F.layer_norm(x, (n,), w, b, 1e-6),), (x,)),
        "fused_add_rms_norm": (lambda: tuple(tf.fused_add_rms_norm(x, r, w, 1e-6)),
                               lambda: (lambda s: (F.rms_norm(s, (n,), w, 1e-6), s))(x + r), (x, r)),
    }
    if op == "rms_norm_rope":
        q, wq, cos, sin, dy = rope_in
        d = q.shape[-1]

        def hf():  # Qwen3RMSNorm then apply_rotary_pos_emb's rotation
            y = F.rms_norm(q, (d,), wq, 1e-6)
            return (y * cos + torch.cat((-y[..., d // 2:], y[..., : d // 2]), -1) * sin,)
        ops[op] = (lambda: (tf.rms_norm_rope(q, wq, cos, sin, 1e-6),), hf, (q,))
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


def _inputs(torch, dry: bool):
    device, dtype, shape = ("cpu", torch.float32, (64, 256)) if dry else ("cuda", torch.bfloat16, (4096, 1024))
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    x, r, dy = rand(*shape).requires_grad_(), rand(*shape).requires_grad_(), rand(*shape)
    w, b = rand(shape[1]) * 0.1 + 1, rand(shape[1]) * 0.1
    return x, r, w, b, dy


def _rope_inputs(torch, dry: bool):
    """``(q, w, cos, sin, dq)``: q the [B, H, S, D] view of a [B, S, H, D] projection (Qwen3's, 2 x 4096
    tokens, 16 heads of 128; dry: 1 x 8, 2 heads of 16), HF's tables [1, 1, S, D], a frozen weight."""
    device, dtype, (B, S, H, D) = ("cpu", torch.float32, (1, 8, 2, 16)) if dry else ("cuda", torch.bfloat16,
                                                                                   (2, 4096, 16, 128))
    gen = torch.Generator(device=device).manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    q = rand(B, S, H, D).transpose(1, 2).requires_grad_()
    theta = rand(1, 1, S, D // 2).float() * 3
    cos, sin = (torch.cat([f(theta), f(theta)], -1).to(dtype) for f in (torch.cos, torch.sin))
    return q, rand(D) * 0.1 + 1, cos, sin, rand(B, H, S, D)


def worker(dry: bool, cases: list = CASES) -> dict:
    """Time every case in this process (the tree to measure is first on sys.path)."""
    import torch
    import torch.nn.functional as F

    import torch_frontend as tf
    from benchmarks.timing import Timer, torch_sync

    x, r, w, b, dy = _inputs(torch, dry)
    rope_in = _rope_inputs(torch, dry) if any(op == "rms_norm_rope" for op, _ in cases) else None
    timer = Timer(dry=True) if dry else Timer(warmup_ms=100, rep_ms=400, batches=7)
    out = {"normkit_file": tf.__file__}
    for op, kind in cases:
        ours, eager = _calls(tf, F, torch, op, kind, x, r, w, b, dy, rope_in)
        for name, fn in (("normkit", ours), ("eager", eager)):
            fn()  # compile / first-call work outside the timing
            out[f"{op} {kind} {name}"] = timer.loop(lambda _i, fn=fn: fn(), torch_sync)
    return out


def renamed_copy(src: Path, dst: Path, i: int) -> tuple[str, str]:
    """``src``'s ``normkit`` and ``torch_frontend`` copied into ``dst`` as ``nk_<i>`` and ``tf_<i>`` (imports,
    module references, the torch.library namespace and resource lookups renamed), so that several
    trees import in one process; returns the two package names."""
    nk, tf = f"nk_{i}", f"tf_{i}"
    rules = [(r"\b(from|import) normkit\b", rf"\1 {nk}"), (r"\b(from|import) torch_frontend\b", rf"\1 {tf}"),
             (r"\bnormkit\.(?=[A-Za-z_])", f"{nk}."), (r"\btorch_frontend\.(?=[A-Za-z_])", f"{tf}."),
             (r'"normkit(::|")', rf'"{nk}\1')]
    for pkg, new in (("normkit", nk), ("torch_frontend", tf)):
        shutil.rmtree(dst / new, ignore_errors=True)
        shutil.copytree(src / pkg, dst / new, ignore=shutil.ignore_patterns("__pycache__"))
        for f in (dst / new).rglob("*.py"):
            text = f.read_text()
            for pattern, repl in rules:
                text = re.sub(pattern, repl, text)
            f.write_text(text)
    return nk, tf


def same_process_worker(packages: list, dry: bool, blocks: int, block_calls: int, cases: list = CASES) -> dict:
    """Every tree's calls and eager's, in one process, in interleaved blocks (the module docstring)."""
    import importlib

    import torch
    import torch.nn.functional as F

    from benchmarks.timing import torch_sync

    x, r, w, b, dy = _inputs(torch, dry)
    rope_in = _rope_inputs(torch, dry) if any(op == "rms_norm_rope" for op, _ in cases) else None
    mods = {name: importlib.import_module(tf) for name, tf in packages}
    out = {"files": {name: m.__file__ for name, m in mods.items()}, "cases": {}}
    sync = torch_sync if not dry else (lambda _out: None)
    for op, kind in cases:
        fns = {}
        for name, m in mods.items():
            fns[name], eager = _calls(m, F, torch, op, kind, x, r, w, b, dy, rope_in)
        fns["eager"] = eager
        for fn in fns.values():  # compile / first-call work, and a warm-up, outside the timing
            for _ in range(1 if dry else 20):
                fn()
        names, times = list(fns), {name: [] for name in fns}
        for block in range(blocks):
            for name in names[block % len(names):] + names[:block % len(names)]:
                fn = fns[name]
                sync(fn())
                t = time.perf_counter()
                for _ in range(block_calls):
                    last = fn()
                sync(last)
                times[name].append((time.perf_counter() - t) / block_calls * 1e6)
        out["cases"][f"{op} {kind}"] = times
    return out


def _same_process(a, trees: dict) -> dict:
    work = REPO / "build" / "host_ab_trees"
    work.mkdir(parents=True, exist_ok=True)
    packages = [(name, renamed_copy(Path(path).resolve(), work, i)[1]) for i, (name, path) in enumerate(trees.items())]
    code = ("import sys, json; sys.path[:0] = [%r, %r]; from benchmarks.host_ab import same_process_worker; "
            "print(json.dumps(same_process_worker(%r, %r, %d, %d, %r)))"
            % (str(work), str(REPO), packages, a.dry_run, a.blocks, a.block_calls, a.cases))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit("host_ab: the same-process worker failed")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, tf in packages:
        if not res["files"][name].startswith(str(work / tf)):
            raise SystemExit(f"host_ab: tree {name} imported {res['files'][name]}, not its renamed copy")
    names, rows = list(trees), []
    for op, kind in a.cases:
        times = res["cases"][f"{op} {kind}"]
        for name in names:
            rows.append({"op": op, "call": kind, "tree": name, "normkit_us": statistics.median(times[name]),
                         "eager_us": statistics.median(times["eager"]),
                         "ratio": statistics.median(o / e for o, e in zip(times[name], times["eager"])),
                         "vs_first": statistics.median(o / f for o, f in zip(times[name], times[names[0]]))})
    return {"rows": rows, "runs": res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (repeat)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for host_ab.json and host_ab.md")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny fp32 shapes, one call per figure")
    p.add_argument("--same-process", action="store_true",
                   help="every tree in one process, interleaved blocks of calls (the module docstring)")
    p.add_argument("--blocks", type=int, default=40, help="--same-process: blocks per case")
    p.add_argument("--block-calls", type=int, default=100, help="--same-process: calls per block")
    p.add_argument("--rope", action="store_true",
                   help="also rms_norm_rope (Qwen3's q), for trees that have it, against HF's two functions eager")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.cases = [tuple(c) for c in CASES + (ROPE_CASES if a.rope else [])]
    if a.worker:
        print(json.dumps(worker(a.dry_run, a.cases)))
        return 0
    trees = dict(t.split("=", 1) for t in a.tree)
    if len(trees) < 2:
        p.error("name at least two trees: --tree before=PATH --tree after=PATH")
    for name, path in trees.items():
        if not (Path(path) / "torch_frontend").is_dir():
            p.error(f"--tree {name}={path}: no torch_frontend/ there")
    names = list(trees)
    if a.same_process:
        if a.dry_run:
            a.blocks, a.block_calls = min(a.blocks, 2), 1
        return _report(a, trees, **_same_process(a, trees))
    runs = {name: [] for name in names}
    for rnd in range(a.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            path = str(Path(trees[name]).resolve())
            code = ("import sys; sys.path[:0] = [%r, %r]; from benchmarks.host_ab import main; "
                    "sys.exit(main(sys.argv[1:]))" % (path, str(REPO)))
            cmd = [sys.executable, "-c", code, "--worker"] + (["--dry-run"] if a.dry_run else []) + (
                ["--rope"] if a.rope else [])
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
    for op, kind in a.cases:
        for name in names:
            ours = [r[f"{op} {kind} normkit"] for r in runs[name]]
            eager = [r[f"{op} {kind} eager"] for r in runs[name]]
            rows.append({"op": op, "call": kind, "tree": name, "normkit_us": statistics.median(ours),
                         "eager_us": statistics.median(eager),
                         "ratio": statistics.median(o / e for o, e in zip(ours, eager))})
    return _report(a, trees, rows, runs)


def _report(a, trees: dict, rows: list, runs) -> int:
    from benchmarks.env import versions

    same = a.same_process
    result = {"trees": trees, "mode": "same-process" if same else "processes", "dry_run": a.dry_run,
              "versions": versions(), "rows": rows, "runs": runs}
    result.update({"blocks": a.blocks, "block_calls": a.block_calls} if same else {"rounds": a.rounds})
    extra = " ÷ first tree |" if same else ""
    lines = ["| op | call | tree | normkit µs | eager µs | normkit ÷ eager |" + extra,
             "|---|---|---|---|---|---|" + ("---|" if same else "")]
    lines += [f"| {r['op']} | {r['call']} | {r['tree']} | {r['normkit_us']:.1f} | {r['eager_us']:.1f} | {r['ratio']:.2f} |"
              + (f" {r['vs_first']:.3f} |" if same else "") for r in rows]
    print("\n".join(lines))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_ab.json").write_text(json.dumps(result, indent=1))
        (out / "host_ab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
