"""One LoRA training step of a random-init Llama, with HF's, Liger's or normkit's RMSNorm.

What a user sees: a ``transformers`` Llama wrapped by PEFT LoRA (r=16, alpha 32, dropout 0, on
q_proj/k_proj/v_proj/o_proj), so every norm weight is frozen, and a training step is

    loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

with AdamW over the LoRA parameters only. The model is ``benchmarks.models.llama_lora``'s; its
variants (each from a deep copy of one base model, so all start from the same weights, and see the
same tokens) are the norms of ``benchmarks.models.swap_norms``: ``hf`` (transformers' ``LlamaRMSNorm``),
``liger`` (``LigerRMSNorm`` swapped in), ``normkit`` (``torch_frontend.patch_model(model)``; its report
is printed and recorded) and ``normkit_fused`` (``patch_model(model, fuse_residual_add=True)``: what
Inductor does for ``hf`` under ``torch.compile``); each eager, under ``torch.compile(model)``
(default mode) and under ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs; each step
begins with ``torch.compiler.cudagraph_mark_step_begin()``). Within a mode every variant is built,
compiled, checked and warmed up first; then ``--rounds`` rounds of timed steps run interleaved across
the variants, so that a drift of the machine lands on all of them alike, each round starting one
variant later than the one before (a variant's place in the round must not decide its time).

A variant may be named again with a suffix, ``hf#2``: an independent copy (its own model copy, its
own compile, its own row). ``--variants hf,normkit,hf#2`` is the A/A control of a comparison: the
difference between ``hf`` and ``hf#2`` is what the measurement cannot resolve.

Per row: median / min / max step time over ``--steps`` steps after ``--warmup`` (wall time of each
step, synchronized before and after: ``benchmarks.timing.Timer.each``), the first step's loss and LoRA gradient norm against the
``hf`` row, eager when it ran (the check), whether any norm weight got a ``.grad`` (it must not), peak memory,
and the share of the norm in one profiled step (``torch.profiler``, CPU + CUDA):

- ``by name``: CUDA kernels whose names are the variant's norm kernels (normkit:
  ``norm_fwd_kernel``/``norm_bwd_kernel``/``partial_sum_kernel`` of normkit/kernels/norm.py; Liger:
  ``_rms_norm_{forward,backward}_kernel`` and their ``_block_`` forms). Exact, eager and compiled.
- ``by module``: (eager rows only; the figure for ``hf``, whose norm is a handful of generic aten
  kernels) forward: the device time of everything launched while a norm module's forward runs (a
  ``record_function`` range opened and closed by forward pre/post hooks, present in the profiled
  step only); backward: the device time of the autograd nodes that those forwards created, matched
  by the profiler's own forward/backward link (a backward node carries the sequence number and
  thread of the forward op that created it). The accumulation of the norm's dx into the residual
  gradient is an engine step outside the node and is not counted.
- compiled ``hf``: not attributed. Inductor fuses the norm with its neighbours (the residual add,
  casts), so no kernel is the norm's alone.

The step's CUDA time is the sum of all device activity (kernels, memcpy, memset) of the profiled
step; "norm %" is the norm's share of it. On a CPU (``--dry-run``) the times are CPU times of the
same ranges and mean nothing; the run only exercises the code.

A time budget (``--budget-s``) bounds the run: the modes run in the order eager, compile,
reduce-overhead, and a mode whose rows would end after the budget (by the time the same kind of row
took, or an estimate before one has run: ``ESTIMATE_S`` a row) is recorded as "skipped: ...". A variant
that cannot run is recorded as "unavailable: ...", one that raised as "failed: ...". The exit status is
1 when an hf or normkit(_fused) row failed or did not pass its checks (after the results are written);
a Liger row's failure is reported but does not change it. It is 2 when no row ran at all (the budget
skipped every mode).

GPU machine, from the repository root (liger-kernel from its wheel, as benchmarks/README.md installs it)::

    PYTHONPATH=/tmp/site:. TRITON_CACHE_DIR=/tmp/triton_cache HOME=/tmp python3 benchmarks/lora_step.py --out "$OUT"

CPU smoke run (tiny fp32 model, Triton's interpreter, eager only, < 1 min)::

    python benchmarks/lora_step.py --dry-run --out /tmp/lora-dry
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import platform
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

T_START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.env import versions  # noqa: E402
from benchmarks.models import (ALL_LINEAR_TARGETS, ARCHS, LORA_TARGETS, Unavailable, llama_lora,  # noqa: E402
                               norm_modules, swap_norms)
from benchmarks.report import markdown_table  # noqa: E402
from benchmarks.timing import Timer, torch_sync  # noqa: E402

SCHEMA = "normkit-lora-step/1"
# run order within a mode; hf first: it is the reference. normkit_input: normkit keeping each norm's input
# (save="input"), the control of what keeping the output saves; normkit_apart: normkit without the
# adapters' shared copy (share_adapter_copy=False), the control of what sharing it saves.
VARIANTS = ("hf", "normkit", "normkit_fused", "normkit_input", "normkit_apart", "normkit_convert", "normkit_rope",
            "liger")
TARGETS = {"attn": LORA_TARGETS, "all-linear": ALL_LINEAR_TARGETS}
MODES = ("eager", "compile", "reduce-overhead")  # reduce-overhead: torch.compile with CUDA graphs
FWD_SCOPE = "lora_step::norm_forward"
STEP_SCOPE = "lora_step::step"
EVALUATE = "autograd::engine::evaluate_function"
_NORMKIT_KERNELS = re.compile(r"norm_fwd_kernel|norm_bwd_kernel|partial_sum_kernel|rms_norm_rope_(fwd|bwd)_kernel")
NORM_KERNELS = {
    "normkit": _NORMKIT_KERNELS,
    "normkit_fused": _NORMKIT_KERNELS,
    "normkit_input": _NORMKIT_KERNELS,
    "normkit_apart": _NORMKIT_KERNELS,
    "normkit_convert": _NORMKIT_KERNELS,
    "normkit_rope": _NORMKIT_KERNELS,
    "liger": re.compile(r"_(block_)?rms_norm_(forward|backward)_kernel"),
}
ESTIMATE_S = {"eager": 20.0, "compile": 90.0, "reduce-overhead": 90.0}  # a row's cost before one of its kind has run
# Default tolerances of the first-step check against hf, relative: (loss, LoRA gradient norm).
TOLERANCES = {torch.bfloat16: (5e-3, 5e-2), torch.float16: (5e-3, 5e-2), torch.float32: (1e-5, 1e-3)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

GPU_DEFAULTS = dict(layers=4, hidden=4096, intermediate=None, heads=32, vocab=32000, seq=4096, batch=2,
                    dtype="bf16", steps=20, warmup=3)
DRY_DEFAULTS = dict(layers=2, hidden=64, intermediate=128, heads=4, vocab=256, seq=16, batch=1,
                    dtype="fp32", steps=2, warmup=1, head_dim=16)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Profiler analysis


def _device_events(events) -> list:
    """Kernels, memcpys and memsets; not the device-side copies of ``record_function`` ranges
    (``gpu_user_annotation``), which span other device events (torch's own tables skip them too)."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith("lora_step::")]


def _us(e) -> float:
    return float(e.time_range.elapsed_us())


def norms_of(variant: str) -> str:
    """The norms a variant name runs: ``hf#2`` is a second copy of ``hf``."""
    return variant.split("#", 1)[0]


def norm_by_name(events, variant: str):
    """(fwd_us, bwd_us, {kernel name: [count, us]}) of the variant's own norm kernels, or None (no
    pattern for the variant, or none of its kernels ran)."""
    pattern = NORM_KERNELS.get(norms_of(variant))
    if pattern is None:
        return None
    fwd = bwd = 0.0
    kernels: dict = {}
    for e in _device_events(events):
        if not pattern.search(e.name):
            continue
        entry = kernels.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += _us(e)
        if "bwd" in e.name or "backward" in e.name or "partial_sum" in e.name:
            bwd += _us(e)
        else:
            fwd += _us(e)
    # None where none ran (a compiled frozen norm runs Inductor's kernels): unattributed, not 0 ms
    return (fwd, bwd, kernels) if kernels else None


def norm_by_module(events, on_gpu: bool):
    """(fwd_us, bwd_us, n_forward_ranges, n_backward_nodes): the norm modules' forward ranges and the
    autograd nodes those forwards created (see the module docstring)."""
    measure = (lambda e: float(e.device_time_total)) if on_gpu else (lambda e: float(e.cpu_time_total))
    events = list(events)
    markers = [e for e in events if e.name == FWD_SCOPE and e.device_type == DeviceType.CPU]
    fwd = sum(measure(m) for m in markers)
    by_thread: dict = {}  # forward thread -> [(start, sequence_nr)] of the ops that recorded one
    for e in events:
        if e.device_type == DeviceType.CPU and e.sequence_nr >= 0 and not e.name.startswith(EVALUATE):
            by_thread.setdefault(e.thread, []).append((e.time_range.start, e.sequence_nr))
    for v in by_thread.values():
        v.sort()
    created = set()  # (forward thread, sequence_nr) of the autograd nodes created inside a range
    for m in markers:
        ops = by_thread.get(m.thread, [])
        inside = {s for t, s in ops if m.time_range.start <= t < m.time_range.end}
        after = next((s for t, s in ops if t >= m.time_range.end), None)
        if after is None:
            continue
        # An op records the next sequence number to be handed out; numbers below the first one
        # recorded after the range were handed out inside it.
        created.update((m.thread, s) for s in inside if s < after)
    # Sequence numbers count per forward thread. With one forward thread (the usual case) a node is
    # matched by its number alone, which does not depend on how the profiler numbers threads.
    one_thread = len({m.thread for m in markers}) == 1
    if one_thread:
        created = {(None, s) for _, s in created}
    nodes = [e for e in events
             if e.device_type == DeviceType.CPU and e.cpu_parent is not None and e.cpu_parent.name.startswith(EVALUATE)
             and not e.name.startswith(EVALUATE)
             and (None if one_thread else e.fwd_thread, e.sequence_nr) in created]
    bwd = sum(measure(n) for n in nodes)
    return fwd, bwd, len(markers), len(nodes)


class NormScopes:
    """Forward pre/post hooks on the norm modules that open/close a ``record_function`` range."""

    def __init__(self, modules):
        self.handles = []
        self.open = []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._exit))

    def _enter(self, module, args):
        rf = record_function(FWD_SCOPE)
        rf.__enter__()
        self.open.append(rf)

    def _exit(self, module, args, output):
        self.open.pop().__exit__(None, None, None)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


# ---------------------------------------------------------------------------------------------
# One row


def _stats(ms: list) -> dict:
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "mean": statistics.fmean(ms)}


def _converting(fwd):
    """``fwd`` with the forward kernel's copy of y for the adapters turned off while it runs
    (``torch_frontend.functional._KERNEL_COPIES`` emptied): each shared copy is then converted by
    ``y.to``, as before the kernel wrote it. ``normkit_convert``, the control of what the kernel's copy
    saves; under torch.compile the adapters convert as PEFT does, so there it is ``normkit``."""
    from torch_frontend import functional

    def call(*args, **kwargs):
        kernel_copies = functional._KERNEL_COPIES
        functional._KERNEL_COPIES = frozenset()
        try:
            return fwd(*args, **kwargs)
        finally:
            functional._KERNEL_COPIES = kernel_copies
    return call


class Row:
    """One variant in one mode: its model, optimizer and training step, alive while the mode's rounds run."""

    def __init__(self, variant: str, mode: str, base, ids, device, mask=None):
        self.row: dict = {"variant": variant, "mode": mode}
        self.variant, self.mode, self.device = variant, mode, device
        self.t0 = time.perf_counter()
        self.model = copy.deepcopy(base)
        self.row["prepare"] = swap_norms(self.model, norms_of(variant))
        self.norms = norm_modules(self.model)
        self.row["norm_modules"] = dict(Counter(type(m).__name__ for _, m in self.norms))
        self.norm_params = {f"{n}.{pn}": p for n, m in self.norms for pn, p in m.named_parameters(recurse=False)}
        self.row["norm_weights_frozen"] = all(not p.requires_grad for p in self.norm_params.values())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.row["trainable_params"] = sum(p.numel() for p in self.params)
        self.row["trainable_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in self.params})
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.fwd = self.model if mode == "eager" else torch.compile(
            self.model, mode="reduce-overhead" if mode == "reduce-overhead" else None)
        if norms_of(variant) == "normkit_convert":
            self.fwd = _converting(self.fwd)
        self.ids, self.mask = ids, mask
        self.times_ms: list = []
        self.rounds_ms: list = []
        self.step_peak_gb = None  # GiB above the allocation at a round's start, the largest of the rounds (CUDA)
        self.last_loss = None

    def step(self, check: bool = False):
        if self.mode == "reduce-overhead":  # each step's CUDA-graph outputs may be overwritten by the next
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.fwd(input_ids=self.ids, labels=self.ids, attention_mask=self.mask, use_cache=False).loss
        loss.backward()
        out = None
        if check:
            grads = [p.grad.float().norm() for p in self.params if p.grad is not None]
            gnorm = torch.stack(grads).norm().item() if grads else 0.0
            out = (loss.item(), gnorm, sorted(n for n, p in self.norm_params.items() if p.grad is not None))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.detach().clone()  # a copy: a CUDA-graph output is reused by the next replay
        return out

    def first_steps(self, warmup: int) -> None:
        """The checked (compiling) first step, then the warm-up steps."""
        t = time.perf_counter()
        loss0, gnorm0, with_grad = self.step(check=True)
        torch_sync()
        self.row["first_step_s"] = time.perf_counter() - t
        self.row["loss_first"], self.row["lora_grad_norm_first"] = loss0, gnorm0
        self.row["norm_weights_with_grad"] = with_grad
        for _ in range(max(warmup - 1, 0)):
            self.step()

    def time_round(self, steps: int) -> None:
        cuda = self.device.type == "cuda"
        if cuda:  # the models of every variant are resident together: measure this variant's steps alone
            torch_sync()
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        us = Timer.each(self.step, steps, torch_sync)
        if cuda:
            peak = (torch.cuda.max_memory_allocated(self.device) - before) / 2**30
            self.step_peak_gb = peak if self.step_peak_gb is None else max(self.step_peak_gb, peak)
        ms = [t / 1e3 for t in us]
        self.times_ms += ms
        self.rounds_ms.append(statistics.median(ms))

    def finish(self, args, profile: bool) -> dict:
        row = self.row
        if self.device.type == "cuda":
            row["step_peak_gb"] = self.step_peak_gb
        row["loss_last"] = self.last_loss.item()
        row["step_ms"] = _stats(self.times_ms)
        row["round_medians_ms"] = self.rounds_ms
        row["steps"], row["warmup"] = len(self.times_ms), args.warmup
        row["timer"] = ("wall time of each step, synchronized before and after (benchmarks.timing.Timer.each), "
                        f"{len(self.rounds_ms)} rounds interleaved with the mode's other variants, each round's order rotated")
        if profile:
            row.update(profile_step(lambda: self.step(), self.variant, self.mode, self.norms, self.device,
                                    steps=args.profile_steps))
        row["status"] = "ok"
        return row

    def close(self) -> None:
        """Free the model. Compiled code is reset by ``run_mode`` once every row of the mode is closed:
        a reset while another compiled row is alive would make that row compile again."""
        del self.model, self.opt, self.fwd
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.row["wall_s"] = time.perf_counter() - self.t0


def _failed(row: dict, e: Exception) -> None:
    traceback.print_exc()
    status = "unavailable" if isinstance(e, Unavailable) else "failed"
    row["status"] = f"{status}: {type(e).__name__ + ': ' if status == 'failed' else ''}{str(e).splitlines()[0] if str(e) else ''}"[:400]


def run_mode(mode: str, variants: list, base, ids, device, args, ref, mask=None) -> list:
    """Every variant of one mode: each prepared (compiled, checked, warmed up), then ``args.rounds``
    rounds of timed steps interleaved across the variants (a drift of the machine's speed then
    lands on every variant alike), then each profiled. Returns the rows, hf first."""
    live, rows = [], []
    for variant in variants:
        log(f"{variant} {mode}: preparing")
        r = None
        try:
            r = Row(variant, mode, base, ids, device, mask)
            r.first_steps(args.warmup)
            live.append(r)
        except Exception as e:  # noqa: BLE001  (one row's failure is recorded; the others still run)
            row = r.row if r is not None else {"variant": variant, "mode": mode}
            _failed(row, e)
            if r is not None:
                r.close()
            rows.append(row)
    per_round = max(1, args.steps // args.rounds)
    for k in range(args.rounds):
        shift = k % len(live) if live else 0  # each round starts one variant later than the one before
        order = live[shift:] + live[:shift]
        for r in order:
            try:
                r.time_round(per_round)
            except Exception as e:  # noqa: BLE001
                _failed(r.row, e)
                live.remove(r)
                r.close()
                rows.append(r.row)
        log(f"{mode} round {k + 1}/{args.rounds}: " + ", ".join(f"{r.variant} {r.rounds_ms[-1]:.2f} ms" for r in order
                                                                 if r in live))
    for r in live:
        try:
            rows.append(r.finish(args, profile=not args.no_profile))
        except Exception as e:  # noqa: BLE001
            _failed(r.row, e)
            rows.append(r.row)
        finally:
            r.close()
    if mode != "eager":
        torch.compiler.reset()
    order = {v: i for i, v in enumerate(variants)}
    return sorted(rows, key=lambda row: order[row["variant"]])


def profile_step(step, variant, mode, norms, device, steps: int = 1) -> dict:
    """Profile ``steps`` steps; every time and count is per step (one step's profile moved by
    ±2 ms between runs, as much as the differences it is meant to explain)."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # By module needs every norm call to go through its module's forward; normkit_fused calls the
    # post-attention norms from the decoder layer (fused with the add), so it is attributed by name only.
    scopes = NormScopes([m for _, m in norms]) if mode == "eager" and norms_of(variant) != "normkit_fused" else None
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function(STEP_SCOPE):
                    step()
            torch_sync()
    finally:
        if scopes is not None:
            scopes.remove()
    return analyze(prof.events(), variant, mode, on_gpu, scoped=scopes is not None, steps=steps)


def analyze(events, variant: str, mode: str, on_gpu: bool, scoped: bool, steps: int = 1) -> dict:
    """The profiled steps' total and the norm's part of it, per step (see the module docstring)."""
    out: dict = {"profiled_steps": steps}
    if on_gpu:
        dev = _device_events(events)
        total_us = sum(_us(e) for e in dev) / steps
        out["profile_basis"] = f"CUDA device time (kernels, memcpy, memset) per step, {steps} profiled step(s)"
        every: dict = {}
        for e in dev:
            entry = every.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += _us(e)
        kernels = [{"name": n[:200], "count": c / steps, "ms": us / steps / 1e3}
                   for n, (c, us) in sorted(every.items(), key=lambda kv: -kv[1][1])]
        out["top_kernels"] = kernels[:12]
        # Inductor names a generated kernel after the ops it fused; a norm's reduction carries rsqrt.
        out["inductor_rsqrt_kernels"] = [k for k in kernels if k["name"].startswith("triton_") and "rsqrt" in k["name"]]
        out["all_kernels"] = kernels
    else:
        total_us = sum(float(e.cpu_time_total) for e in events
                       if e.name == STEP_SCOPE and e.device_type == DeviceType.CPU) / steps
        out["profile_basis"] = f"CPU time per step, {steps} profiled step(s) (dry run: no device kernels; meaningless as a share)"
    out["profiled_step_ms"] = total_us / 1e3

    by_name = norm_by_name(events, variant) if on_gpu else None
    if by_name is not None:
        f, b, kernels = by_name
        out["norm_by_name"] = {"fwd_ms": f / steps / 1e3, "bwd_ms": b / steps / 1e3,
                               "kernels": {n: {"count": c / steps, "ms": us / steps / 1e3}
                                           for n, (c, us) in kernels.items()}}
    if scoped:
        f, b, n_fwd, n_bwd = norm_by_module(events, on_gpu)
        out["norm_by_module"] = {"fwd_ms": f / steps / 1e3, "bwd_ms": b / steps / 1e3,
                                 "forward_ranges": n_fwd / steps, "backward_nodes": n_bwd / steps}

    if "norm_by_name" in out:
        chosen, method = out["norm_by_name"], "by kernel name"
    elif "norm_by_module" in out:
        chosen, method = out["norm_by_module"], "by module (forward range + the autograd nodes it created)"
    else:
        chosen = None
        method = ("not attributed: Inductor fuses the norm with neighbouring ops, no kernel is the norm's alone"
                  if on_gpu else "not attributed: a CPU run has no device kernels to name")
    out["norm_method"] = method
    if chosen is not None:
        out["norm_ms"] = chosen["fwd_ms"] + chosen["bwd_ms"]
        out["norm_pct"] = 100.0 * out["norm_ms"] / out["profiled_step_ms"] if total_us > 0 else None
    else:
        out["norm_ms"] = out["norm_pct"] = None
    return out


def check_row(row: dict, ref: dict | None, args) -> None:
    notes = []
    ok = True
    if not row.get("norm_weights_frozen"):
        ok = False
        notes.append("a norm weight requires grad")
    if row.get("norm_weights_with_grad"):
        ok = False
        notes.append(f"norm weights got a .grad: {row['norm_weights_with_grad'][:3]}")
    if not math.isfinite(row["loss_first"]):
        ok = False
        notes.append("first loss is not finite")
    if ref is None:
        notes.append("no hf row to compare with")
    else:
        row["reference"] = f"hf {ref['mode']}"
        loss_tol, grad_tol = args.loss_rtol, args.grad_rtol
        d = abs(row["loss_first"] - ref["loss_first"])
        row["loss_diff_vs_hf"] = d
        row["loss_tol"] = loss_tol * max(1.0, abs(ref["loss_first"]))
        g_ref = ref["lora_grad_norm_first"]
        row["grad_rel_diff_vs_hf"] = abs(row["lora_grad_norm_first"] - g_ref) / max(abs(g_ref), 1e-30)
        row["grad_tol"] = grad_tol
        if not d <= row["loss_tol"]:
            ok = False
            notes.append(f"first loss differs from {row['reference']} by {d:.3g} > {row['loss_tol']:.3g}")
        if not row["grad_rel_diff_vs_hf"] <= grad_tol:
            ok = False
            notes.append(f"LoRA grad norm differs from {row['reference']} by {row['grad_rel_diff_vs_hf']:.3g} "
                         f"(relative) > {grad_tol}")
    row["checks_ok"] = ok
    row["check_notes"] = notes


# ---------------------------------------------------------------------------------------------
# Output


def _f(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


COLUMNS = ("variant", "mode", "status", "median ms", "min", "max", "speedup vs hf", "first step s", "loss",
           "Δloss vs hf", "grad rel Δ", "norm ms", "norm % of step", "norm attribution", "step mem GB", "step mem vs hf")


def table(rows: list) -> str:
    ref = {r["mode"]: r["step_ms"]["median"] for r in rows if r["variant"] == "hf" and r.get("status") == "ok"}
    peak = {r["mode"]: r.get("step_peak_gb") for r in rows if r["variant"] == "hf" and r.get("status") == "ok"}
    cells = []
    for r in rows:
        ok = r.get("status") == "ok"
        status = r["status"] if not ok else ("ok" if r.get("checks_ok") else "CHECK FAILED")
        row = dict.fromkeys(COLUMNS, "-")
        row.update(variant=r["variant"], mode=r["mode"], status=status.replace("|", "/"))
        if ok:
            s, sp = r["step_ms"], ref.get(r["mode"])
            row.update({"median ms": f"{s['median']:.2f}", "min": f"{s['min']:.2f}", "max": f"{s['max']:.2f}",
                        "speedup vs hf": _f(sp / s["median"] if sp else None, ".3f"),
                        "first step s": f"{r['first_step_s']:.1f}", "loss": f"{r['loss_first']:.4f}",
                        "Δloss vs hf": _f(r.get("loss_diff_vs_hf"), ".2e"),
                        "grad rel Δ": _f(r.get("grad_rel_diff_vs_hf"), ".2e"), "norm ms": _f(r.get("norm_ms"), ".3f"),
                        "norm % of step": _f(r.get("norm_pct"), ".1f"),
                        "norm attribution": r.get("norm_method", "-").split(":")[0],
                        "step mem GB": _f(r.get("step_peak_gb"), ".2f"),
                        "step mem vs hf": _f(r["step_peak_gb"] / peak[r["mode"]] if r.get("step_peak_gb") is not None
                                             and peak.get(r["mode"]) else None, ".3f")})
        cells.append(row)
    return markdown_table(cells)


def markdown(result: dict) -> str:
    c, env = result["config"], result["env"]
    kv = c.get("kv_heads")
    out = [
        "# LoRA training step: HF vs Liger vs normkit RMSNorm",
        "",
        f"{ {'qwen3': 'Qwen3', 'gemma3': 'Gemma 3'}.get(c.get('arch'), 'Llama')} (random init): {c['layers']} layers, hidden "
        f"{c['hidden']}, intermediate {c['intermediate']}, {c['heads']} heads"
        f"{f' ({kv} key/value)' if kv else ''}"
        f", vocab {c['vocab']}; batch {c['batch']} x seq {c['seq']}"
        f"{', an attention mask (the first sequence left-padded)' if c.get('mask') else ''}, {c['dtype']} on "
        f"{env.get('device_name', c['device'])}. PEFT LoRA r=16 alpha 32 on {', '.join(c['lora']['targets'])} "
        f"(norm weights frozen; adapters in "
        f"{'the model dtype' if c['lora'].get('adapter_dtype') == 'model' else 'float32, PEFT default'}); AdamW over the LoRA parameters. {c['steps']} timed steps after {c['warmup']} "
        f"warmup{' (dry run: numbers mean nothing)' if c['dry_run'] else ''}.",
        "",
        f"Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".",
        "",
        table(result["rows"]),
        "",
        "Norm attribution: " + result["attribution"],
        "",
    ]
    out.append("Step mem GB: the largest peak of CUDA memory allocated during one round of this variant's timed "
               "steps, less what was allocated when the round began (every variant's model and optimizer state): "
               "the step's activations, gradients and temporaries.")
    out.append("")
    rounds = max((len(r.get("round_medians_ms", [])) for r in result["rows"]), default=0)
    out.append(f"Timing: {rounds} rounds per mode, interleaved across the mode's variants, each round starting one "
               "variant later than the one before; median over every timed step.")
    copies = sorted({r["variant"] for r in result["rows"] if "#" in r["variant"]})
    if copies:
        out.append(f"{', '.join(f'`{v}`' for v in copies)}: an independent copy of `{norms_of(copies[0])}` (its own model "
                   "copy and compile), timed like the others: its distance to the original is what this run "
                   "cannot resolve.")
    out.append("")
    described = set()
    for r in result["rows"]:
        how = r.get("prepare", {}).get("how")
        if how and r["variant"] not in described:
            described.add(r["variant"])
            out.append(f"- `{r['variant']}`: {how}")
        if r.get("check_notes"):
            out.append(f"- `{r['variant']}` {r['mode']}: " + "; ".join(r["check_notes"]))
        if r.get("inductor_rsqrt_kernels"):
            ks = r["inductor_rsqrt_kernels"]
            out.append(f"- `{r['variant']}` {r['mode']}: Inductor kernels with a norm's rsqrt, per step: "
                       f"{sum(k['count'] for k in ks):g} launches, {sum(k['ms'] for k in ks):.3f} ms; "
                       + "; ".join(f"`{k['name'][:90]}` x{k['count']:g} {k['ms']:.3f} ms" for k in ks[:4]))
        if r.get("norm_by_module") and r.get("norm_by_name"):
            by_name, by_module = (r[k]["fwd_ms"] + r[k]["bwd_ms"] for k in ("norm_by_name", "norm_by_module"))
            out.append(f"- `{r['variant']}` {r['mode']}: norm by kernel name {by_name:.3f} ms, by module "
                       f"{by_module:.3f} ms (cross-check of the two attributions)")
    reports = {r["variant"]: r["prepare"]["patch_report"] for r in result["rows"]
               if r.get("prepare", {}).get("patch_report")}
    for variant, report in reports.items():
        out += ["", f"`{variant}` patch report:", "", "```", report, "```"]
    out += ["", f"Total {result['total_s']:.0f} s, budget {result['budget_s']} s"
                + ("." if result.get("complete") else "; INCOMPLETE (written after the last row that finished)."), ""]
    return "\n".join(out)


ATTRIBUTION = (
    "by kernel name (normkit: norm_fwd_kernel/norm_bwd_kernel/partial_sum_kernel; Liger: "
    "_rms_norm_{forward,backward}_kernel, _block_ forms) on every GPU row whose variant has its own kernels; "
    "by module for eager hf (and as a cross-check on eager normkit/liger): the device time under a "
    "record_function range around each norm module's forward, plus that of the autograd nodes those forwards "
    "created (matched by the profiler's forward/backward sequence numbers); compiled hf is not attributed "
    "(Inductor fuses the norm with its neighbours). Share = norm time / all device activity of the profiled step.")


def write_outputs(out_dir: Path, result: dict) -> None:
    result["total_s"] = time.perf_counter() - T_START
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora_step.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / "lora_step.md").write_text(markdown(result))


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int, help="default: hidden * 11008 / 4096 (64-aligned)")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, help="default: hidden / heads (qwen3, gemma3: 128)")
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="qwen3, gemma3: QK-norm before the rotary embedding (the normkit_rope variant fuses the two)")
    p.add_argument("--mask", action="store_true",
                   help="pass an attention mask with the first 1/16 of the first sequence padded: transformers' "
                        "SDPA attention then gets a mask and copies k and v for GQA (repeat_kv) instead of "
                        "passing them as they are")
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--targets", choices=sorted(TARGETS), default="attn",
                   help="the LoRA-wrapped linears: attn (q/k/v/o_proj) or all-linear (also gate/up/down_proj)")
    p.add_argument("--adapter-dtype", choices=("float32", "model"), default="float32",
                   help="float32: PEFT's default (autocast_adapter_dtype=True: fp32 adapters on a bf16 model, each "
                        "keeping an fp32 copy of its input); model: the adapters in the model's dtype, keeping "
                        "their input (the norm's output) itself (benchmarks.models.llama_lora)")
    p.add_argument("--steps", type=int, help="timed steps per variant, split over --rounds")
    p.add_argument("--rounds", type=int, default=3, help="rounds of timed steps, interleaved across a mode's variants")
    p.add_argument("--warmup", type=int, help="steps before timing, the first (checked, compiling) one included")
    p.add_argument("--variants", default="hf,liger,normkit,normkit_fused",
                   help="comma list of hf, liger, normkit, normkit_fused, normkit_input, normkit_apart, "
                        "normkit_convert, normkit_rope")
    p.add_argument("--modes", default=None, help="eager,compile,reduce-overhead (default all on a GPU, eager on CPU)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled steps (no norm share)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled for the norm share (per-step means)")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="skip rows that would end after this many seconds from the start (0: no budget)")
    p.add_argument("--loss-rtol", type=float, help="relative tolerance of the first loss vs hf (eager if it ran)")
    p.add_argument("--grad-rtol", type=float, help="relative tolerance of the first LoRA grad norm vs hf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for lora_step.json and lora_step.md "
                                               "(default benchmarks/results, /tmp/normkit-lora-step-dry on a dry run)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny fp32 model, 2 steps, eager only unless --modes says otherwise; implied on a CPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    defaults = DRY_DEFAULTS if dry else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dtype = DTYPES[args.dtype]
    loss_tol, grad_tol = TOLERANCES[dtype]
    args.loss_rtol = loss_tol if args.loss_rtol is None else args.loss_rtol
    args.grad_rtol = grad_tol if args.grad_rtol is None else args.grad_rtol
    modes = args.modes.split(",") if args.modes else (["eager"] if dry else list(MODES))
    if args.no_compile:
        modes = [m for m in modes if m == "eager"]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if norms_of(v) not in VARIANTS] + [m for m in modes if m not in MODES]
    bad += sorted({v for v in variants if variants.count(v) > 1})
    if bad:
        raise SystemExit(f"unknown variant/mode {bad}; variants {VARIANTS}, modes {MODES}")
    out_dir = Path(args.out) if args.out else (
        Path("/tmp/normkit-lora-step-dry") if dry else REPO / "benchmarks" / "results")
    device = torch.device("cuda" if cuda else "cpu")

    env = {"versions": versions(),
           "device_name": torch.cuda.get_device_name(device) if cuda else (platform.processor() or "cpu")}
    cfg = {k: getattr(args, k) for k in ("arch", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                         "vocab", "seq", "batch", "dtype", "steps", "warmup", "seed", "mask")}
    cfg.update(device=device.type, dry_run=dry, modes=modes, variants=variants, lora={
        "r": 16, "alpha": 32, "dropout": 0.0, "targets": list(TARGETS[args.targets]), "adapter_dtype": args.adapter_dtype},
        optimizer="AdamW(lr=1e-4), LoRA params",
        loss_rtol=args.loss_rtol, grad_rtol=args.grad_rtol)
    log(f"config {json.dumps(cfg)}")
    log(f"versions {json.dumps(env['versions'])}")

    base, _ = llama_lora(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim, arch=args.arch,
                         vocab=args.vocab, max_positions=max(args.seq, 128), dtype=dtype, device=device, seed=args.seed,
                         targets=TARGETS[args.targets], adapter_dtype=args.adapter_dtype)
    cfg["intermediate"] = base.config.intermediate_size
    cfg["attn_implementation"] = getattr(base.config, "_attn_implementation", None)
    cfg["total_params"] = sum(p.numel() for p in base.parameters())
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen, device=device)
    mask = None
    if args.mask:
        mask = torch.ones_like(ids)
        mask[0, : max(1, args.seq // 16)] = 0  # left padding of the first sequence
    log(f"built the base model: {cfg['total_params'] / 1e6:.1f} M parameters, attention {cfg['attn_implementation']}")

    rows, ref, took = [], None, {}
    result = {"schema": SCHEMA, "argv": sys.argv[1:], "config": cfg, "env": env, "rows": rows,
              "attribution": ATTRIBUTION, "budget_s": args.budget_s, "complete": False}
    ordered = sorted(variants, key=lambda v: (VARIANTS.index(norms_of(v)), v))  # hf first: the reference
    for mode in (m for m in MODES if m in modes):
        elapsed = time.perf_counter() - T_START
        estimate = took.get(mode, ESTIMATE_S[mode]) * len(ordered)
        if args.budget_s > 0 and elapsed + estimate > args.budget_s:
            for variant in ordered:
                rows.append({"variant": variant, "mode": mode, "status": (
                    f"skipped: budget ({elapsed:.0f} s elapsed + ~{estimate:.0f} s for the {mode} rows > --budget-s "
                    f"{args.budget_s:.0f})")})
            log(f"{mode}: {rows[-1]['status']}")
            write_outputs(out_dir, result)
            continue
        for row in run_mode(mode, ordered, base, ids, device, args, ref, mask):
            rows.append(row)
            if row["status"] == "ok" or row["status"].startswith("failed"):
                took[mode] = max(took.get(mode, 0.0), row.get("wall_s", 0.0))
            if row["variant"] == "hf" and row["status"] == "ok" and ref is None:
                ref = row  # eager hf when it ran (it runs first), else compiled hf
            if row["status"] == "ok":
                check_row(row, ref, args)
            variant, msg = row["variant"], row["status"]
            if row["status"] == "ok":
                msg = (f"median {row['step_ms']['median']:.2f} ms (rounds {', '.join(f'{m:.2f}' for m in row['round_medians_ms'])}; "
                       f"min {row['step_ms']['min']:.2f}, max {row['step_ms']['max']:.2f}), first step "
                       f"{row['first_step_s']:.1f} s, loss {row['loss_first']:.5f} (vs hf {_f(row.get('loss_diff_vs_hf'), '.2e')}), "
                       f"device {_f(row.get('profiled_step_ms'), '.2f')} ms/step, norm {_f(row.get('norm_ms'), '.3f')} ms "
                       f"= {_f(row.get('norm_pct'), '.1f')} % [{row.get('norm_method', '-')}]"
                       + ("" if row.get("checks_ok") else f"; CHECK FAILED: {'; '.join(row['check_notes'])}"))
            if row.get("prepare", {}).get("patch_report"):
                print(row["prepare"]["patch_report"], flush=True)
            log(f"{variant} {mode}: {msg}")
        write_outputs(out_dir, result)  # after every mode: a run cut short still leaves its rows
    del base

    result["complete"] = True
    write_outputs(out_dir, result)
    print()
    print(table(rows))
    print()
    log(f"wrote {out_dir / 'lora_step.json'} and {out_dir / 'lora_step.md'}")
    if not any(r["status"] == "ok" or r["status"].startswith("failed") for r in rows):
        # a run that measured nothing is not a success: the budget is checked against each mode's
        # estimate (ESTIMATE_S) before any row of it runs
        print(f"NOTHING RAN: {'; '.join(sorted({r['status'] for r in rows}))}. Pass a larger --budget-s, or 0 "
              "for none.", flush=True)
        return 2
    failed = [r for r in rows if r["status"].startswith("failed") or (r["status"] == "ok" and not r.get("checks_ok"))]
    for r in failed:
        print(f"{'WARNING (peer)' if norms_of(r['variant']) == 'liger' else 'FAILED'}: {r['variant']} {r['mode']}: "
              f"{r['status'] if r['status'] != 'ok' else '; '.join(r['check_notes'])}", flush=True)
    return 1 if any(norms_of(r["variant"]) != "liger" for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
