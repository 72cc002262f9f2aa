"""QK-norm + RoPE alone: normkit's ``rms_norm_rope`` against HF's two functions, eager and compiled, and Liger.

The call a Qwen3 attention makes: q ``[B, S, H, D]`` (and k ``[B, S, KV, D]``), each the view of a
projection's output, normalized per head, transposed to ``[B, H, S, D]`` and rotated with cos/sin
``[B, S, D]``; the norm weight frozen (LoRA), x needing a gradient. Timed forward + backward through
autograd (``torch.autograd.grad``: x's gradient returned, as a projection's output gets it in a
training step, not accumulated into a leaf's ``.grad``):

- ``hf_eager``: ``Qwen3RMSNorm`` then ``apply_rotary_pos_emb`` (transformers' own functions);
- ``torch_compile``: ``torch.compile`` of that same function;
- ``liger``: ``LigerRMSNorm`` then ``liger_rotary_pos_emb`` (Liger's kernels; it rotates q and k
  together, so it runs only where k is present, ``--kv-heads`` > 0);
- ``normkit_norm``: normkit's ``rms_norm`` then HF's rotation (``patch_model`` without ``qk_norm_rope``);
- ``normkit``: ``torch_frontend.rms_norm_rope`` (``patch_model(qk_norm_rope=True)``), q and k each;
- ``copy``: the bytes the fused op must move, and nothing else: ``out.copy_(x)`` (the forward: read x,
  write out) then ``torch.add(out, dy, out=dx)`` (the backward: read the kept output and dy, write dx).

Byte model (per tensor of x's size, ``|x|``): 5 |x| (forward read x, write out; backward read out and
dy, write dx) plus the tables read once in each pass (4 |cos|). TB/s divides those bytes by the time.

Timers (benchmarks/timing.py): ``kernel``, do_bench's median with the L2 flushed before each call
(device time, host time included where the call is host-bound); ``device``, the GPU's own time per
call (the summed durations of the kernels and copies it launches, from ``torch.profiler``: host time
left out, so a host-bound call's kernels are seen apart); ``loop``, the median wall time per call of
back-to-back calls. Each implementation's result is checked against ``hf_eager`` in fp32
(out and dx) before it is timed.

GPU machine, from the repository root::

    PYTHONPATH=. python3 benchmarks/rope_bench.py --out "$OUT"

CPU smoke run (tiny shapes, Triton's interpreter; numbers mean nothing)::

    python benchmarks/rope_bench.py --dry-run
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.env import short_error, versions  # noqa: E402
from benchmarks.report import markdown_table  # noqa: E402
from benchmarks.timing import Timer, tbps, torch_sync  # noqa: E402

SCHEMA = "normkit-rope-bench/1"
IMPLS = ("hf_eager", "torch_compile", "liger", "normkit_norm", "normkit", "copy")


def _hf():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    return Qwen3RMSNorm, apply_rotary_pos_emb


def build(impl: str, D: int, weights: tuple, eps: float):
    """``f(q, k, cos, sin) -> (q_out, k_out)`` (k and k_out may be None) for ``impl``; raises
    RuntimeError with the reason where it cannot run."""
    Qwen3RMSNorm, apply_rotary_pos_emb = _hf()
    wq, wk = weights
    if impl in ("hf_eager", "torch_compile", "normkit_norm"):
        norms = []
        for w in weights:
            if impl == "normkit_norm":
                import torch_frontend as tf

                norms.append(lambda t, w=w: tf.rms_norm(t, w, eps))
            else:
                m = Qwen3RMSNorm(D, eps=eps).to(w.device, w.dtype)
                m.weight = torch.nn.Parameter(w, requires_grad=False)
                norms.append(m)

        def f(q, k, cos, sin):
            qn = norms[0](q).transpose(1, 2)
            kn = norms[1](k).transpose(1, 2) if k is not None else qn
            qo, ko = apply_rotary_pos_emb(qn, kn, cos, sin)
            return qo, (ko if k is not None else None)

        return torch.compile(f) if impl == "torch_compile" else f
    if impl == "normkit":
        import torch_frontend as tf

        def f(q, k, cos, sin):
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            return (tf.rms_norm_rope(q.transpose(1, 2), wq, c, s, eps),
                    None if k is None else tf.rms_norm_rope(k.transpose(1, 2), wk, c, s, eps))

        return f
    if impl == "liger":
        try:
            from liger_kernel.transformers import LigerRMSNorm
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"liger_kernel does not import: {short_error(e)}") from None
        norms = []
        for w in weights:
            m = LigerRMSNorm(D, eps=eps, offset=0.0, casting_mode="llama", in_place=True).to(w.device, w.dtype)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            norms.append(m)

        def f(q, k, cos, sin):
            if k is None:
                raise RuntimeError("Liger's rotary embedding rotates q and k together; run with --kv-heads > 0")
            return liger_rotary_pos_emb(norms[0](q).transpose(1, 2), norms[1](k).transpose(1, 2), cos, sin)

        return f
    raise ValueError(impl)


def _copy_step(buffers):
    """The copy reference: its forward and backward moving the fused op's bytes."""
    def step(q, k, cos, sin, dq, dk):
        for x, dy, pair in ((q, dq, buffers[0]), (k, dk, buffers[1])):
            if x is None:
                continue
            out, dx = pair
            out.copy_(x.transpose(1, 2))
            torch.add(out, dy, out=dx)
        return dx
    return step


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, S, H, KV, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

    q0, k0 = rand(B, S, H, D), (rand(B, S, KV, D) if KV else None)
    dq0 = rand(B, H, S, D)  # [B, H, S, D], as attention's backward gives it
    dk0 = rand(B, KV, S, D) if KV else None
    theta = torch.rand((B, S, D // 2), generator=g, device=device) * 6.28
    cos = torch.cat([theta.cos()] * 2, -1).to(dtype)
    sin = torch.cat([theta.sin()] * 2, -1).to(dtype)
    weights = (torch.empty(D, device=device, dtype=dtype).uniform_(0.5, 1.5, generator=g),
               torch.empty(D, device=device, dtype=dtype).uniform_(0.5, 1.5, generator=g))
    x_bytes = (q0.numel() + (k0.numel() if KV else 0)) * q0.element_size()
    table_bytes = cos.numel() * cos.element_size() * (2 if KV else 1)  # cos and sin, per tensor rotated
    model_bytes = 5 * x_bytes + 2 * 2 * table_bytes
    timer = Timer(dry=not cuda, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    rows = []
    ref = None
    for impl in args.impls:
        row = {"impl": impl}
        rows.append(row)
        t0 = time.perf_counter()
        try:
            if impl == "copy":
                # laid out as the fused op's: the output a [B, H, S, D] view of a [B, S, H, D] buffer
                buffers = [None if x is None else (torch.empty_like(x.transpose(1, 2)),
                                                   torch.empty_like(x.transpose(1, 2))) for x in (q0, k0)]
                step = _copy_step(buffers)

                def fwd_bwd():
                    return step(q0, k0, cos, sin, dq0, dk0)
            else:
                f = build(impl, D, weights, args.eps)
                q = q0.detach().requires_grad_(True)
                k = k0.detach().requires_grad_(True) if KV else None

                inputs = [q] + ([k] if k is not None else [])

                def grads(qo, ko):  # dx returned, not accumulated into a leaf's .grad: in a training step
                    # q and k are projections' outputs, whose gradients flow on without an accumulation
                    return torch.autograd.grad([qo] + ([ko] if ko is not None else []), inputs,
                                               [dq0] + ([dk0] if ko is not None else []))

                def fwd_bwd():
                    return grads(*f(q, k, cos, sin))[0]

                # the check: out and dx against hf_eager's, in fp32
                qo, ko = f(q, k, cos, sin)
                dx = grads(qo, ko)
                got = {"q_out": qo.detach().float(), "dq": dx[0].float()}
                if ko is not None:
                    got.update(k_out=ko.detach().float(), dk=dx[1].float())
                if impl == "hf_eager":
                    ref = got
                elif ref is not None:
                    row["max_abs_diff_vs_hf"] = {n: float((got[n] - ref[n]).abs().max()) for n in got}
                    row["ref_max_abs"] = {n: float(ref[n].abs().max()) for n in got}
            torch_sync()
            row["kernel_us"] = timer.kernel(fwd_bwd)
            row["device_us"] = timer.device(fwd_bwd)
            row["loop_us"] = timer.loop(lambda _i: fwd_bwd(), torch_sync)
            row["tbps"] = tbps(model_bytes, row["kernel_us"])
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            row["status"] = f"unavailable: {short_error(e)}"
        row["wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
    by = {r["impl"]: r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        for peer in ("torch_compile", "copy", "hf_eager"):
            if peer in by and peer != r["impl"]:
                r[f"vs_{peer}"] = r["kernel_us"] / by[peer]["kernel_us"]
                if r["device_us"] is not None:
                    r[f"device_vs_{peer}"] = r["device_us"] / by[peer]["device_us"]
    return {"schema": SCHEMA, "argv": sys.argv[1:], "env": {
        "versions": versions(), "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"},
        "config": {"batch": B, "seq": S, "heads": H, "kv_heads": KV, "head_dim": D, "dtype": args.dtype,
                   "eps": args.eps, "weight": "frozen", "dry_run": not cuda},
        "byte_model": {"x_bytes": x_bytes, "table_bytes": table_bytes, "bytes": model_bytes,
                       "formula": "5 |x| (fwd: read x, write out; bwd: read out and dy, write dx) + 2 passes x "
                                  "(cos + sin), over q and k"},
        "timer": "kernel: do_bench median, L2 flushed before each call (fwd + bwd through torch.autograd.grad); device: "
                 "the summed durations of the GPU activity one call launches (torch.profiler), host time left out; loop: median "
                 "wall time per call, back to back",
        "rows": rows}


def markdown(result: dict) -> str:
    c = result["config"]
    cells = []
    for r in result["rows"]:
        ok = r["status"] == "ok"
        cells.append({"impl": r["impl"], "status": r["status"][:80],
                      "fwd+bwd µs (kernel)": f"{r['kernel_us']:.1f}" if ok else "-",
                      "device µs": f"{r['device_us']:.1f}" if ok and r["device_us"] is not None else "-",
                      "µs per call (loop)": f"{r['loop_us']:.1f}" if ok else "-",
                      "TB/s": f"{r['tbps']:.2f}" if ok else "-",
                      "vs torch_compile": f"{r['vs_torch_compile']:.3f}" if "vs_torch_compile" in r else "-",
                      "vs copy": f"{r['vs_copy']:.3f}" if "vs_copy" in r else "-",
                      "device vs copy": f"{r['device_vs_copy']:.3f}" if "device_vs_copy" in r else "-"})
    shape = f"q [{c['batch']}, {c['seq']}, {c['heads']}, {c['head_dim']}]" + (
        f" and k [{c['batch']}, {c['seq']}, {c['kv_heads']}, {c['head_dim']}]" if c["kv_heads"] else "")
    return "\n".join([
        "# QK-norm + RoPE, forward and frozen backward", "",
        f"{shape}, {c['dtype']}, frozen weight, on {result['env']['device_name']}"
        f"{' (dry run: numbers mean nothing)' if c['dry_run'] else ''}.", "",
        f"Byte model: {result['byte_model']['formula']} = {result['byte_model']['bytes'] / 1e6:.1f} MB.", "",
        f"Timer: {result['timer']}.", "", markdown_table(cells), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="0: q alone")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--out", default=None, help="directory for rope_bench.json and rope_bench.md")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (implied without a GPU)")
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    defaults = dict(batch=1, seq=8, heads=2, kv_heads=1, head_dim=16) if dry else dict(
        batch=2, seq=4096, heads=16, kv_heads=8, head_dim=args.head_dim)
    for k, v in defaults.items():
        if getattr(args, k) is None or (dry and k == "head_dim"):
            setattr(args, k, v)
    args.impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown impls {bad}; expected some of {IMPLS}")
    result = run(args)
    md = markdown(result)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rope_bench.json").write_text(json.dumps(result, indent=1))
        (out / "rope_bench.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
