"""A patched norm writes its output once in the dtype of the PEFT LoRA layers that take it, and keeps that
copy instead of a tensor of its own (``patch_model(share_adapter_copy=True)``, the default).

Under PEFT's defaults a bf16 model gets fp32 adapters, and each LoRA layer converts its input to fp32
and keeps that copy: q, k and v each keep one copy of the same norm output. These tests count what
autograd keeps (saved-tensor hooks) in tiny bf16 Llama and Qwen3 models, and compare the loss and
the LoRA gradients with the unpatched model's, in every PEFT state that changes what a LoRA layer
does with its input (dropout, several adapters, disabled, merged, casting disabled, checkpointing,
unpatched again).
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import peft
import pytest
import torch
import torch.utils._python_dispatch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.helpers import disable_input_dtype_casting

import normkit
import torch_frontend as tf
from normkit.ops import OPS
from normkit.testing import assert_close
from tests.frontend_torch import DEVICE
from torch_frontend import functional as F

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    # Qwen3's QK-norm gets a gradient that cannot be viewed as rows: copied, and said so
    pytest.mark.filterwarnings("ignore::torch_frontend.NormkitCopyWarning"),
]

HIDDEN, LAYERS, SEQ, BATCH, VOCAB = 64, 2, 16, 2, 96
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTN + ["gate_proj", "up_proj", "down_proj"]


def _tiny(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norm weights away from their init (ones), within the range that keeps y
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model.to(DEVICE, torch.bfloat16)


def _lora(model, targets, dropout=0.0, **kw):
    # PEFT's defaults otherwise: fp32 adapters on a bf16 model (autocast_adapter_dtype=True);
    # init_lora_weights=False makes B random too, so every gradient is non-zero
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(model, cfg, **kw)


def _pair(kind="llama", targets=ATTN, dropout=0.0, seed=0, **patch_kw):
    """(the unpatched PEFT model, a patched deep copy of it, the patch report)."""
    ref = _lora(_tiny(kind, seed), targets, dropout)
    model = copy.deepcopy(ref)
    return ref, model, tf.patch_model(model, **patch_kw)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@contextlib.contextmanager
def _kept():
    """The hidden-sized tensors autograd keeps while the block runs, one per storage: ``{data_ptr: dtype}``."""
    kept: dict = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == HIDDEN and t.numel() == BATCH * SEQ * HIDDEN:
            kept.setdefault(t.untyped_storage().data_ptr(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def _step(model, seed: int, dropout_seed: int | None = None):
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    out = model(input_ids=_ids(seed), labels=_ids(seed))
    out.loss.backward()
    return out.loss.detach()


def _assert_same_training(model, ref, seed: int, dropout_seed: int | None = None, run=None) -> None:
    """One step of each (``run``: how ``model`` is called, e.g. compiled): the same loss and LoRA
    gradients, within the bf16 tolerance."""
    loss = _step(model if run is None else run, seed, dropout_seed)
    loss_ref = _step(ref, seed, dropout_seed)
    assert_close(loss.float().item(), loss_ref.float().item(), "bfloat16", "loss")
    _assert_same_grads(model, ref)


def _assert_same_grads(model, ref) -> None:
    ref_params = dict(ref.named_parameters())
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, _ in lora)
    for name, p in lora:
        g_ref = ref_params[name].grad
        assert g_ref is not None and p.grad is not None, name
        scale = float(g_ref.abs().max())
        assert scale > 0, name  # a comparison that can fail
        # relative to the gradient's scale, a sum over the tokens of products of bf16 activations
        assert_close(p.grad.double().cpu().numpy() / scale, g_ref.double().cpu().numpy() / scale, "bfloat16", f"grad {name}",
                     reduced_over=BATCH * SEQ)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       keep=st.booleans(), trained=st.booleans(), rows=st.integers(1, 6), n=st.sampled_from([8, 33, 64]),
       layout=st.sampled_from(["contiguous", "sliced", "transposed"]), seed=st.integers(0, 2**16))
def test_the_copy_and_both_gradients_against_float64(op, dtype, keep, trained, rows, n, layout, seed):
    """The norm's copy of y in fp32 is exactly ``y.float()``, on every op, dtype and row layout, frozen
    (y or the copy kept) or trained (x kept); the backward of y's and the copy's gradients together is
    the float64 reference's for their sum."""
    spec, tdt = OPS[op], getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.1).to(tdt)

    def rows_of(t):  # the row layout a caller hands in, same values
        if layout == "sliced":
            return torch.cat([t, rand(rows, 3)], dim=1)[:, :n]
        if layout == "transposed":
            return t.t().contiguous().t()
        return t

    inputs = {name: rows_of(rand(rows, n)).to(DEVICE) for name in spec.row_inputs}
    params = {}
    if "weight" in spec.params:  # |w| in [1, 2): x_hat recoverable from y
        params["weight"] = (torch.rand(n, generator=g, dtype=torch.float64) + 1.0).to(tdt).to(DEVICE)
    if "bias" in spec.params:
        params["bias"] = rand(n, scale=0.3).to(DEVICE)
    leaves = {k: v.detach().requires_grad_(k in spec.row_inputs or trained) for k, v in {**inputs, **params}.items()}
    opts = spec.options(eps=spec.default_eps)
    outs = F._apply(spec, *(leaves.get(k) for k in ("x", "residual", "weight", "bias")), opts.eps, 0.0, "llama",
                    "auto", None, (torch.float32, keep))
    y = outs[0] if spec.has_residual else outs
    y2 = F.copy_of(y, torch.float32)
    assert y2 is not None and y2.dtype == torch.float32 and torch.equal(y2, y.float())
    dy, dy2 = rand(rows, n).to(DEVICE), rand(rows, n).to(torch.float32).to(DEVICE)
    wrt = [leaves[k] for k in leaves if leaves[k].requires_grad]
    loss = (y.float() * dy.float()).sum() + (y2 * dy2).sum()
    cot = {"y": dy.double().cpu().numpy() + dy2.double().cpu().numpy()}
    if spec.has_residual:
        ds = rand(rows, n).to(DEVICE)
        loss = loss + (outs[1].float() * ds.float()).sum()
        cot["residual_out"] = ds.double().cpu().numpy()
    grads = torch.autograd.grad(loss, wrt)
    _, ref = spec.run_reference({k: v.detach().double().cpu().numpy() for k, v in leaves.items()}, opts, cot)
    for name, got in zip([k for k in leaves if leaves[k].requires_grad], grads):
        assert_close(got.double().cpu().numpy(), ref[name], dtype, f"{op} {dtype} keep={keep} trained={trained}: "
                     f"d{name}", reduced_over=rows if name in spec.params else 1)


# (targets, hidden-sized tensors kept: unpatched, patched without the shared copy, patched with it).
# Per layer with it: one fp32 copy for q/k/v (the input norm keeps that one too), o_proj's own
# conversion, and the second norm's output (its fp32 copy where gate/up take it); plus the final norm's.
KEPT = {"attn": (ATTN, 12, 12, 7), "all-linear": (ALL_LINEAR, 16, 16, 7)}


# The default run: both targets in Llama, the attention's in Qwen3 (its QK-norm); Qwen3 with every
# linear layer is the slow tier.
@pytest.mark.parametrize("kind,targets", [pytest.param(kind, targets, marks=pytest.mark.slow if (kind, targets) == (
    "qwen3", "all-linear") else ()) for kind in ("llama", "qwen3") for targets in sorted(KEPT)])
def test_one_copy_per_norm_is_kept_and_training_is_unchanged(kind, targets):
    names, n_ref, n_apart, n_shared = KEPT[targets]
    ref, model, report = _pair(kind, names, seed=1)
    apart = copy.deepcopy(ref)
    tf.patch_model(apart, share_adapter_copy=False)
    counts, losses = [], []
    for m in (ref, apart, model):
        with _kept() as kept:
            loss = m(input_ids=_ids(2), labels=_ids(2)).loss
        counts.append(len(kept))
        loss.backward()
        losses.append(loss.float().item())
    assert counts == [n_ref, n_apart, n_shared]
    assert_close(losses[2], losses[0], "bfloat16", "loss")
    takers = {"attn": [3], "all-linear": [3, 2]}[targets]
    assert sorted({len(t) for _, t, _ in report.shares}) == sorted(takers)
    assert len(report.shares) == LAYERS * len(takers)
    assert all(d is torch.float32 for _, _, d in report.shares)
    assert "float32 copy with 3 LoRA layer(s)" in str(report)
    _assert_same_grads(model, ref)


def test_the_norm_keeps_the_adapters_copy_itself():
    """The input norm's saved tensor and q/k/v's lora_A inputs are one fp32 tensor."""
    _, model, _ = _pair("llama", ATTN, seed=3)
    layer = model.base_model.model.model.layers[1]
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = layer.input_layernorm(x)
        q, k, v = (getattr(layer.self_attn, n)(y) for n in ("q_proj", "k_proj", "v_proj"))
    copy_ = F.copy_of(y, torch.float32)
    assert copy_ is not None and torch.equal(copy_, y.float())
    hidden = [t for t in packed if t.shape[-1] == HIDDEN and t.numel() == y.numel()]  # lora_A's: 2-d views
    assert len(hidden) == 4 and all(t.untyped_storage().data_ptr() == copy_.untyped_storage().data_ptr()
                                    for t in hidden)
    (q.float().sum() + k.float().square().sum() + v.float().sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _Conversions(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtype conversions of hidden-state-shaped tensors that run inside the block: ``(from, to)``
    each (what ``y.to(dtype)`` would run; the interpreter's own copies move raw bytes)."""

    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            if tuple(src.shape) == (BATCH, SEQ, HIDDEN) and src.dtype != out.dtype:
                self.found.append((src.dtype, out.dtype))
        return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_the_backward_reads_the_kept_copy_as_it_is(op, dtype):
    """A frozen norm keeping the consumers' fp32 copy (``keep``): its output-keeping backward reads that
    copy in place, converting nothing of the rows' size, and its gradients are bit for bit those of
    the same norm keeping y itself; the second call finds its bound launch at once."""
    spec, tdt = OPS[op], getattr(torch, dtype)
    rows, n = 6, 40
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: (torch.randn(*shape, generator=g, dtype=torch.float64) + 0.1).to(tdt).to(DEVICE)  # noqa: E731
    inputs = {name: rand(rows, n) for name in spec.row_inputs}
    params = {"weight": (torch.rand(n, generator=g, dtype=torch.float64) + 1.0).to(tdt).to(DEVICE)}
    if "bias" in spec.params:
        params["bias"] = (torch.randn(n, generator=g, dtype=torch.float64) * 0.3).to(tdt).to(DEVICE)
    dy, dy2 = rand(rows, n), rand(rows, n).float()
    opts = spec.options(eps=spec.default_eps)

    class _RowConversions(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].shape == (rows, n) and args[0].dtype != out.dtype:
                self.found.append((args[0].dtype, out.dtype))
            return out

    results = {}
    for keep in (False, True):
        for call in range(2):
            leaves = {k: v.detach().requires_grad_(k in spec.row_inputs) for k, v in {**inputs, **params}.items()}
            outs = F._apply(spec, *(leaves.get(k) for k in ("x", "residual", "weight", "bias")), opts.eps, 0.0,
                            "llama", "auto", None, (torch.float32, keep))
            y = outs[0] if spec.has_residual else outs
            y2 = F.copy_of(y, torch.float32)
            with normkit.record_launches() as log, _RowConversions() as conversions:
                grads = torch.autograd.grad([y, y2], [leaves[k] for k in spec.row_inputs], [dy, dy2])
            (bwd,) = log.of("norm_bwd_kernel")
            assert bwd.flags["FROM_Y"] and not bwd.flags["COMPUTE_DW"]
            # the gradients' sum (dy2 + dy, in fp32, rounded to dy's dtype) is the only conversion
            assert conversions.found == [(torch.float32, tdt)], (keep, conversions.found)
            results[keep, call] = grads
    for keep_y, keep_copy in zip(results[False, 1], results[True, 1]):
        assert torch.equal(keep_y, keep_copy)
        assert torch.isfinite(keep_copy).all() and keep_copy.abs().sum() > 0


@pytest.mark.parametrize("trained", [False, True])
def test_the_norm_writes_the_copy_in_its_forward_kernel(trained):
    """An eager PEFT step: the input norm's forward is one launch of ``norm_fwd_kernel`` with HAS_Y2, which
    writes y and its fp32 copy; no conversion of y runs beside it. The copy is ``y.float()`` bit for bit,
    and the gradients still reach x (and the trained weight)."""
    _, model, _ = _pair("llama", ATTN, seed=24)
    norm = model.base_model.model.model.layers[0].input_layernorm
    norm.weight.requires_grad_(trained)
    g = torch.Generator().manual_seed(25)
    x = (torch.randn(BATCH, SEQ, HIDDEN, generator=g) * 2 + 0.1).to(torch.bfloat16).to(DEVICE).requires_grad_()
    with normkit.record_launches() as log, _Conversions() as conversions:
        y = norm(x)
    (fwd,) = log.of("norm_fwd_kernel")
    assert fwd.flags["HAS_Y2"] and fwd.flags["STORE_STATS"]
    assert log.kernels() == ["norm_fwd_kernel"] and conversions.found == [], (log, conversions.found)
    copy_ = F.copy_of(y, torch.float32)
    assert copy_ is not None and copy_.dtype == torch.float32
    assert torch.equal(copy_.view(torch.int32), y.float().view(torch.int32))
    ref = OPS["rms_norm"].reference(x.detach().double().cpu().numpy(), norm.weight.detach().double().cpu().numpy(),
                                    eps=norm.eps)
    assert_close(y.double().detach().cpu().numpy(), ref, "bfloat16", "y")
    (copy_ * torch.linspace(-1, 1, HIDDEN, device=DEVICE)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert (norm.weight.grad is not None) == trained


def test_a_call_with_the_copy_and_one_without_do_not_share_a_plan():
    """The copy's dtype is part of the call signature: the same norm and tensors, called with and without
    the copy (and again), launch HAS_Y2 exactly when the copy is asked for, on each route (eager and
    no-grad), and the copy is attached only then."""
    from torch_frontend import _bound

    spec = OPS["rms_norm"]
    g = torch.Generator().manual_seed(26)
    x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    w = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    _bound.clear()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for copy_ in [(torch.float32, True), None, (torch.float32, False), None]:
                with normkit.record_launches() as log:
                    y = F._apply(spec, x, None, w, None, 1e-6, 0.0, "llama", "auto", None, copy_)
                (fwd,) = log.of("norm_fwd_kernel")
                assert fwd.flags["HAS_Y2"] == (copy_ is not None) and fwd.flags["STORE_STATS"] == grad
                c = F.copy_of(y, torch.float32)
                assert (c is None) == (copy_ is None)
                assert c is None or torch.equal(c.view(torch.int32), y.float().view(torch.int32))
    assert len(_bound.BOUND) == 4  # with and without the copy, with and without a backward


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_copy_of_no_rows(op):
    """No rows: no launch, and the copy is an empty fp32 tensor of y's shape."""
    spec = OPS[op]
    x = torch.randn(2, 0, HIDDEN).to(torch.bfloat16).to(DEVICE).requires_grad_()
    args = {"residual": torch.randn(2, 0, HIDDEN).to(torch.bfloat16).to(DEVICE),
            "weight": torch.ones(HIDDEN, dtype=torch.bfloat16, device=DEVICE),
            "bias": torch.zeros(HIDDEN, dtype=torch.bfloat16, device=DEVICE)}
    with normkit.record_launches() as log:
        outs = F._apply(spec, x, *(args[k] if k in spec.inputs else None for k in ("residual", "weight", "bias")),
                        spec.default_eps, 0.0, "llama", "auto", None, (torch.float32, True))
    y = outs[0] if spec.has_residual else outs
    c = F.copy_of(y, torch.float32)
    assert not log.of("norm_fwd_kernel") and c is not None and c.shape == y.shape == x.shape
    assert c.dtype == torch.float32 and c.numel() == 0


def test_dropout_draws_each_adapters_own_mask():
    """With dropout each adapter keeps its own dropped input, so the norm keeps its own bf16 output, as
    without the shared copy."""
    ref, model, _ = _pair("llama", ATTN, dropout=0.3, seed=6)
    apart = copy.deepcopy(ref)
    tf.patch_model(apart, share_adapter_copy=False)
    kept = []
    for m in (apart, model):
        with _kept() as k:
            torch.manual_seed(8)
            loss = m(input_ids=_ids(7), labels=_ids(7)).loss
        kept.append(sorted(str(d) for d in k.values()))
        del loss
    assert kept[0] == kept[1] and "torch.bfloat16" in kept[1]
    _assert_same_training(model, ref, seed=7, dropout_seed=8)


def test_several_adapters():
    ref, model, _ = _pair("llama", ATTN, seed=9)
    second = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    for m in (ref, model):
        torch.manual_seed(10)
        m.add_adapter("second", second)
        m.base_model.set_adapter(["default", "second"])
        for name, p in m.named_parameters():  # set_adapter trains the active adapters only
            p.requires_grad_("lora_" in name)
    _assert_same_training(model, ref, seed=11)


def test_dora_adapters():
    """DoRA's adapters take the shared copy as their input too (PEFT's variant forward gets the converted x)."""
    ref = peft.get_peft_model(_tiny("llama", seed=22), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=ATTN, use_dora=True, init_lora_weights=False))
    model = copy.deepcopy(ref)
    report = tf.patch_model(model)
    assert len(report.shares) == LAYERS
    _assert_same_training(model, ref, seed=23)


def test_disabled_merged_and_uncast_adapters_take_peft_own_conversion():
    ref, model, _ = _pair("llama", ATTN, seed=12)
    ids = _ids(13)
    with torch.no_grad():
        for ctx in (lambda m: m.disable_adapter(), lambda m: contextlib.nullcontext()):
            with ctx(ref):
                want = ref(input_ids=ids).logits
            with ctx(model):
                got = model(input_ids=ids).logits
            assert_close(got.float().cpu().numpy(), want.float().cpu().numpy(), "bfloat16", "logits")
        layer = model.base_model.model.model.layers[0]
        norm, q = layer.input_layernorm, layer.self_attn.q_proj
        x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        assert norm.output_copy(norm, x) == (torch.float32, True)
        with model.disable_adapter():
            assert norm.output_copy(norm, x) is None
        with disable_input_dtype_casting(model):
            assert norm.output_copy(norm, x) is None
            y = norm(x)
            assert q._cast_input_dtype(y, torch.float32) is y  # PEFT's own: no conversion
        model.merge_adapter()
        assert norm.output_copy(norm, x) is None
        model.unmerge_adapter()
        assert norm.output_copy(norm, x) == (torch.float32, True)


def test_a_copy_written_in_place_since_is_not_taken():
    _, model, _ = _pair("llama", ATTN, seed=14)
    layer = model.base_model.model.model.layers[0]
    norm, q = layer.input_layernorm, layer.self_attn.q_proj
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        y = norm(x)
        shared = F.copy_of(y, torch.float32)
        assert q._cast_input_dtype(y, torch.float32) is shared
        y.mul_(2)  # the output changed: the copy is stale
        taken = q._cast_input_dtype(y, torch.float32)
        assert taken is not shared and torch.equal(taken, y.float())
        y2 = norm(x)
        F.copy_of(y2, torch.float32).add_(1)  # the copy changed: PEFT's own conversion of y2
        assert torch.equal(q._cast_input_dtype(y2, torch.float32), y2.float())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_under_gradient_checkpointing(use_reentrant):
    ref, model, _ = _pair("llama", ATTN, seed=15)
    for m in (ref, model):
        if hasattr(m, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        m.enable_input_require_grads()
        m.train()
    _assert_same_training(model, ref, seed=16)


def test_patch_before_peft_and_unpatch_restore_peft():
    base = _tiny("llama", seed=17)
    ref = _lora(copy.deepcopy(base), ATTN)
    tf.patch_model(base)
    model = _lora(base, ATTN)  # PEFT wraps q/k/v after the norms were patched: found when called
    model.load_state_dict(ref.state_dict())
    with _kept() as kept:
        loss = model(input_ids=_ids(18), labels=_ids(18)).loss
    assert len(kept) == KEPT["attn"][3]
    del loss
    report = tf.unpatch_model(model)
    assert report.casts == 3 * LAYERS and "restored PEFT's own input conversion in 6" in str(report)
    assert not any("_cast_input_dtype" in m.__dict__ for m in model.modules())
    with _kept() as kept:
        loss = model(input_ids=_ids(18), labels=_ids(18)).loss
    assert len(kept) == KEPT["attn"][1]
    del loss
    _assert_same_training(model, ref, seed=19)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
def test_a_compiled_model_trains_as_the_unpatched_one():
    """Under ``torch.compile`` each LoRA layer converts as PEFT does (Inductor fuses the conversions),
    in one graph: the shared copy's checks trace away."""
    ref, model, _ = _pair("llama", ATTN, seed=20)
    _assert_same_training(model, ref, seed=21, run=torch.compile(model, backend="aot_eager", fullgraph=True))
