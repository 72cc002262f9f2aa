"""torch_frontend.patch_model: swapped norms compute what the originals computed, keep their
Parameters, run the dW-free backward under LoRA, and leave unknown modules alone.

References are the unpatched modules themselves (a deep copy taken before patching), on fresh random
inputs and non-trivial norm weights (HF initializes them to ones, Gemma to zeros).
"""
from __future__ import annotations

import copy
import importlib
import zlib

import numpy as np
import peft
import pytest
import torch
import transformers
from torch import nn

import normkit
import torch_frontend as tf
from torch_frontend.patch import KNOWN, HFRMSNorm
from normkit.testing import assert_close

pytestmark = [
    # peft 0.21 calls transformers' is_gradient_checkpointing, which transformers 5.x deprecates.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HIDDEN, LAYERS, SEQ, BATCH, VOCAB = 64, 2, 16, 2, 96


def _np(t):
    return t.detach().double().cpu().numpy()


def _randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    """Norm weights away from their init (ones / zeros), so a wrong offset or a dropped weight shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((torch.rand(p.shape, generator=gen) + 0.5) * torch.randn(p.shape, generator=gen).sign())


def _tiny(kind: str, seed: int):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=16))
    else:
        raise ValueError(kind)
    _randomize_norms(model, torch.Generator().manual_seed(seed + 1))
    return model


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _step_both(ref, model, seed: int):
    """``(ref's output, model's output, model's launch log)`` of one forward and backward of each."""
    ids = _tokens(seed)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    with normkit.record_launches() as log:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    return out_ref, out, log


def _assert_lora_grads_match(model, ref) -> None:
    """Only LoRA parameters are trained in ``model``, and their gradients are ``ref``'s (non-zero)."""
    ref_params = dict(ref.named_parameters())
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, _ in lora)
    for name, p in lora:
        assert np.abs(_np(ref_params[name].grad)).max() > 0, name  # a comparison that can fail
        assert_close(_np(p.grad), _np(ref_params[name].grad), "float32", f"grad {name}")


# ---------------------------------------------------------------------------------------------
# Whole models: full fine-tuning and LoRA.


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_full_model_outputs_and_gradients_match(kind):
    ref = _tiny(kind, seed=11)
    model = copy.deepcopy(ref)
    report = tf.patch_model(model)
    norm_cls = {"llama": "LlamaRMSNorm", "gemma": "GemmaRMSNorm"}[kind]
    assert len(report.patched) == 2 * LAYERS + 1
    assert {old.__name__ for _, old, _ in report.patched} == {norm_cls}
    assert not any(type(m).__name__ == norm_cls for m in model.modules())

    out_ref, out, log = _step_both(ref, model, 12)
    assert len(log.of("norm_fwd_kernel")) == 2 * LAYERS + 1
    # Every norm weight is trained here, so every backward reduces dW.
    assert len(log.of("partial_sum_kernel")) == 2 * LAYERS + 1
    assert all(launch.flags["COMPUTE_DW"] for launch in log.of("norm_bwd_kernel"))

    assert_close(_np(out.logits), _np(out_ref.logits), "float32", "logits")
    assert_close(out.loss.item(), out_ref.loss.item(), "float32", "loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close(_np(p.grad), _np(ref_params[name].grad), "float32", f"grad {name}",
                     reduced_over=BATCH * SEQ if "norm" in name else 1)


def _lora(model):
    # init_lora_weights=False: B random too, so A's gradients are not trivially zero.
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_lora_path_runs_dw_free_backward(kind):
    ref = _lora(_tiny(kind, seed=21))
    model = copy.deepcopy(ref)
    report = tf.patch_model(model)
    assert len(report.patched) == 2 * LAYERS + 1
    norm_weights = [m.weight for m in model.modules() if isinstance(m, tf.RMSNorm)]
    assert len(norm_weights) == 2 * LAYERS + 1 and not any(w.requires_grad for w in norm_weights)

    out_ref, out, log = _step_both(ref, model, 22)

    bwd = log.of("norm_bwd_kernel")
    # The first input norm sees the frozen embeddings (no grad needed at all); every later norm's
    # input depends on a LoRA adapter, so it needs dx only.
    assert len(bwd) == 2 * LAYERS
    for launch in bwd:
        assert launch.flags["COMPUTE_DX"] and not launch.flags["COMPUTE_DW"] and not launch.flags["COMPUTE_DB"]
        assert launch.partial_buffers == ()
    assert log.of("partial_sum_kernel") == []
    assert all(w.grad is None for w in norm_weights)

    assert_close(out.loss.item(), out_ref.loss.item(), "float32", "loss")
    _assert_lora_grads_match(model, ref)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_lora_under_hf_gradient_checkpointing(use_reentrant):
    """transformers' gradient checkpointing over a patched LoRA model: the checkpointed layers' forward
    runs twice (once without keeping anything, once again in the backward), and the norms' backward
    computes no dW and gives the unpatched, un-checkpointed model's LoRA gradients. Reentrant, the
    recomputed forward is an ordinary one and its norms keep the output; non-reentrant, the
    recomputation's saved tensors stand in for the forward's, so the checkpointed layers' norms keep
    the input (``normkit.saving.decide``: a decision that cannot disagree between forward and
    recomputation), and the final norm, outside the checkpoints, the output. What keeping the output
    saves is transient there anyway: a checkpointed layer holds its activations only while its own
    backward runs, so one norm input at a time, not one per norm."""
    ref = _lora(_tiny("llama", seed=31))
    model = copy.deepcopy(ref)
    tf.patch_model(model)
    model.train()
    if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:  # the reentrant checkpoint needs an input that requires grad (the embeddings are frozen)
        model.enable_input_require_grads()
    out_ref, out, log = _step_both(ref, model, 32)
    fwd, bwd = log.of("norm_fwd_kernel"), log.of("norm_bwd_kernel")
    assert len(fwd) == 2 * (2 * LAYERS) + 1  # the layers' norms twice (forward, then recomputed), the final one once
    # checkpointing a model with frozen embeddings makes their output require grad (transformers' own
    # enable_input_require_grads for adapters): the first norm computes a dx as well
    assert len(bwd) == 2 * LAYERS + 1
    for launch in bwd:
        assert launch.flags["COMPUTE_DX"] and not launch.flags["COMPUTE_DW"], launch.flags
    from_y = [launch.flags["FROM_Y"] for launch in bwd]
    assert from_y.count(True) == (len(bwd) if use_reentrant else 1), from_y
    assert log.of("partial_sum_kernel") == []
    assert_close(out.loss.item(), out_ref.loss.item(), "float32", "loss")
    _assert_lora_grads_match(model, ref)


def test_lora_with_one_trained_norm_reduces_only_that_one():
    ref = _lora(_tiny("llama", seed=31))
    ref.base_model.model.model.norm.weight.requires_grad_(True)  # e.g. a norm listed in modules_to_save
    model = copy.deepcopy(ref)
    tf.patch_model(model)
    ids = _tokens(32)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    with normkit.record_launches() as log:
        model(input_ids=ids, labels=ids).loss.backward()
    assert [launch.flags["COMPUTE_DW"] for launch in log.of("norm_bwd_kernel")].count(True) == 1
    assert len(log.of("partial_sum_kernel")) == 1
    w, w_ref = model.base_model.model.model.norm.weight, ref.base_model.model.model.norm.weight
    assert_close(_np(w.grad), _np(w_ref.grad), "float32", "final norm dW", reduced_over=BATCH * SEQ)


def test_patch_after_peft_keeps_parameter_objects_and_state_dict():
    model = _lora(_tiny("llama", seed=41))
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    tf.patch_model(model)
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(after[n] is before[n] for n in before)
    assert list(model.state_dict()) == keys


# ---------------------------------------------------------------------------------------------
# Every known transformers class, module by module, across dtypes.


def _known_hf_classes():
    out = []
    for (modpath, name), _ in KNOWN.items():
        if modpath.startswith("transformers."):
            out.append(pytest.param(modpath, name, id=name))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("modpath,name", _known_hf_classes())
def test_each_known_hf_class_matches_its_original(modpath, name, dtype):
    try:
        cls = getattr(importlib.import_module(modpath), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{modpath}.{name} is not in this transformers")
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    D = 48
    orig = cls(D, eps=1e-5).to(DTYPES[dtype])
    _randomize_norms(nn.ModuleDict({"norm": orig}), gen)
    holder = nn.Sequential(copy.deepcopy(orig))
    report = tf.patch_model(holder)
    assert len(report.patched) == 1 and report.patched[0][1] is cls
    new = holder[0]
    assert isinstance(new, tf.RMSNorm) and new.eps == 1e-5

    x = (torch.randn(3, 5, D, generator=gen) * 2 + 0.5).to(DTYPES[dtype])
    dy = torch.randn(3, 5, D, generator=gen).to(DTYPES[dtype])
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = orig(xa), new(xb)
    assert ya.dtype == yb.dtype
    ya.backward(dy)
    yb.backward(dy)
    assert_close(_np(yb), _np(ya), dtype, f"{name} y")
    assert_close(_np(xb.grad), _np(xa.grad), dtype, f"{name} dx")
    assert_close(_np(new.weight.grad), _np(orig.weight.grad), dtype, f"{name} dw", reduced_over=15)


def test_hf_llama_norm_keeps_the_promoted_output_dtype():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    orig = LlamaRMSNorm(32, eps=1e-6)  # fp32 weight ...
    _randomize_norms(nn.ModuleDict({"n": orig}), torch.Generator().manual_seed(5))
    holder = nn.Sequential(copy.deepcopy(orig))
    tf.patch_model(holder)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)  # ... bf16 input
    y_ref, y = orig(x), holder[0](x)
    assert y_ref.dtype == y.dtype == torch.float32
    assert_close(_np(y), _np(y_ref), "bfloat16", "y")
    assert isinstance(holder[0], HFRMSNorm) and holder[0].variance_epsilon == 1e-6


# ---------------------------------------------------------------------------------------------
# torch.nn.RMSNorm and torch.nn.LayerNorm.


def _check_swapped_module(orig, dtype, shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    holder = nn.Sequential(copy.deepcopy(orig))
    report = tf.patch_model(holder)
    assert len(report.patched) == 1, str(report)
    new = holder[0]
    x = ((torch.randn(shape, generator=gen) + 0.3) * scale).to(DTYPES[dtype])
    dy = torch.randn(shape, generator=gen).to(DTYPES[dtype])
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = orig(xa), new(xb)
    assert ya.dtype == yb.dtype
    ya.backward(dy)
    yb.backward(dy)
    assert_close(_np(yb), _np(ya), dtype, "y")
    assert_close(_np(xb.grad) * scale, _np(xa.grad) * scale, dtype, "dx")
    M = x.numel() // shape[-1]
    for pname in ("weight", "bias"):
        p_orig, p_new = getattr(orig, pname, None), getattr(new, pname, None)
        assert (p_orig is None) == (p_new is None), pname
        if p_orig is not None:
            assert_close(_np(p_new.grad), _np(p_orig.grad), dtype, f"d{pname}", reduced_over=M)
    return new


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("affine", [True, False])
def test_torch_rms_norm_swap(dtype, eps, affine):
    orig = nn.RMSNorm(40, eps=eps, elementwise_affine=affine, dtype=DTYPES[dtype])
    if affine:
        _randomize_norms(nn.ModuleDict({"norm": orig}), torch.Generator().manual_seed(7))
    # Small inputs make eps matter: mean(x**2) ~ 1e-4, where finfo(bfloat16).eps (7.8e-3) would be far off.
    new = _check_swapped_module(orig, dtype, (6, 40), scale=1e-2, seed=8)
    assert type(new) is tf.RMSNorm
    assert new.eps == (torch.finfo(torch.float32).eps if eps is None else eps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_torch_layer_norm_swap(dtype, affine, bias):
    orig = nn.LayerNorm(40, eps=1e-5, elementwise_affine=affine, bias=bias, dtype=DTYPES[dtype])
    if affine:
        gen = torch.Generator().manual_seed(9)
        with torch.no_grad():
            orig.weight.copy_(torch.rand(40, generator=gen) + 0.5)
            if bias:
                orig.bias.copy_(torch.randn(40, generator=gen))
    new = _check_swapped_module(orig, dtype, (2, 5, 40), seed=10)
    assert type(new) is tf.LayerNorm
    assert list(new.state_dict()) == list(orig.state_dict())


def test_frozen_torch_norms_get_no_grad():
    model = nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24), nn.RMSNorm(24, eps=1e-6), nn.Linear(24, 4))
    for m in (model[1], model[2]):
        for p in m.parameters():
            p.requires_grad_(False)
    tf.patch_model(model)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    with normkit.record_launches() as log:
        model(x).square().sum().backward()
    assert model[1].weight.grad is None and model[1].bias.grad is None and model[2].weight.grad is None
    assert model[0].weight.grad is not None
    bwd = log.of("norm_bwd_kernel")
    assert len(bwd) == 2 and not any(b.flags["COMPUTE_DW"] or b.flags["COMPUTE_DB"] for b in bwd)
    assert log.of("partial_sum_kernel") == []


# ---------------------------------------------------------------------------------------------
# What is left alone, idempotence, unpatching.


class MyNorm(nn.Module):  # norm-looking, not known: must be left alone
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True) * self.weight


class LlamaRMSNorm(nn.Module):  # a namesake of transformers' class with different math: not known
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * self.weight


def test_unknown_model_is_left_as_it_was():
    import transformers.models.llama.modeling_llama  # noqa: F401  (the real class is loaded)

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 16), MyNorm(16), nn.GroupNorm(4, 16), LlamaRMSNorm(16), nn.Linear(16, 2))
    before = list(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 16)
    y_before = model(x)
    report = tf.patch_model(model)
    assert report.patched == []
    assert [(n, c) for n, c, _ in report.skipped] == [("1", MyNorm), ("2", nn.GroupNorm), ("3", LlamaRMSNorm)]
    assert "named like transformers.models.llama.modeling_llama.LlamaRMSNorm" in report.skipped[2][2]
    assert all(a is b for a, b in zip(model, before))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(model(x), y_before)
    assert str(report).splitlines()[0] == "normkit: patched 0 module(s), skipped 3"


def test_skip_reasons_for_unsupported_known_modules():
    hooked = nn.RMSNorm(8)
    hooked.register_forward_hook(lambda m, i, o: None)
    model = nn.ModuleDict({
        "multi_dim": nn.LayerNorm((4, 8)),
        "fp64": nn.RMSNorm(8, dtype=torch.float64),
        "hooked": hooked,
        "ok": nn.LayerNorm(8),
    })
    report = tf.patch_model(model)
    assert [n for n, _, _ in report.patched] == ["ok"]
    reasons = {n: r for n, _, r in report.skipped}
    assert "spans several dims" in reasons["multi_dim"]
    assert "float64" in reasons["fp64"]
    assert "forward hooks" in reasons["hooked"]
    only_rms = nn.ModuleDict({"ln": nn.LayerNorm(8), "rms": nn.RMSNorm(8)})
    report = tf.patch_model(only_rms, layer_norm=False)
    assert [n for n, _, _ in report.patched] == ["rms"] and type(only_rms["ln"]) is nn.LayerNorm


def test_patch_twice_changes_nothing_and_unpatch_restores():
    model = _lora(_tiny("llama", seed=51))
    originals = {n: m for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    ids = _tokens(52)
    with torch.no_grad():
        loss_orig = model(input_ids=ids, labels=ids).loss.item()

    first = tf.patch_model(model)
    patched = {n: m for n, m in model.named_modules() if n in originals}
    second = tf.patch_model(model)
    assert len(first.patched) == len(originals) and second.patched == []
    assert {n for n, _, _ in second.skipped} == set(originals)
    assert all(r == "already a normkit module" for _, _, r in second.skipped)
    assert all(dict(model.named_modules())[n] is m for n, m in patched.items())
    with torch.no_grad():
        loss_patched = model(input_ids=ids, labels=ids).loss.item()
    assert_close(loss_patched, loss_orig, "float32", "loss")

    restored = tf.unpatch_model(model)
    assert len(restored.patched) == len(originals)
    assert all(dict(model.named_modules())[n] is m for n, m in originals.items())
    assert tf.unpatch_model(model).patched == []
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == loss_orig


def test_shared_module_is_swapped_everywhere():
    norm = nn.LayerNorm(8)
    model = nn.ModuleDict({"a": nn.Sequential(norm), "b": nn.Sequential(norm)})
    report = tf.patch_model(model)
    assert len(report.patched) == 1  # named_modules lists a shared module once
    assert model["a"][0] is model["b"][0] and isinstance(model["a"][0], tf.LayerNorm)
    assert model["a"][0].weight is norm.weight
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(_np(model["a"](x)), _np(norm(x)), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# fuse_residual_add: the decoder layers' add before post_attention_layernorm, fused into that norm.


def _tiny_causal_lm(cls_name: str, config_name: str, seed: int):
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)
    model = getattr(transformers, cls_name)(cfg)
    _randomize_norms(model, torch.Generator().manual_seed(seed + 1))
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", [("LlamaForCausalLM", "LlamaConfig"), ("Qwen2ForCausalLM", "Qwen2Config")],
                         ids=["llama", "qwen2"])
def test_fused_residual_add_matches_the_unfused_model(arch, dtype):
    """Under LoRA: the fused layers launch one fused add + RMSNorm per layer (frozen: no dW), their
    forward is bitwise that of the unfused normkit model (the kernel rounds the sum to x.dtype as
    torch's add does), and the gradients agree with HF's own model within the tolerance table; in
    fp32 the gradients equal the unfused model's bitwise."""
    base = _tiny_causal_lm(*arch, seed=41).to(DTYPES[dtype])
    ref = _lora(base)
    unfused, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    tf.patch_model(unfused)
    report = tf.patch_model(fused, fuse_residual_add=True)
    assert len(report.fused) == LAYERS and not report.skipped, str(report)
    assert "fused   2 x" in str(report)

    ids = _tokens(42)
    outs = {}
    for name, model in (("ref", ref), ("unfused", unfused)):
        outs[name] = model(input_ids=ids, labels=ids)
        outs[name].loss.backward()
    with normkit.record_launches() as log:
        outs["fused"] = fused(input_ids=ids, labels=ids)
        outs["fused"].loss.backward()
    fwd = log.of("norm_fwd_kernel")
    assert sum(launch.flags["HAS_RESIDUAL"] for launch in fwd) == LAYERS and len(fwd) == 2 * LAYERS + 1
    assert not any(launch.flags["COMPUTE_DW"] for launch in log.of("norm_bwd_kernel"))
    assert not log.of("partial_sum_kernel")

    assert torch.equal(outs["fused"].logits, outs["unfused"].logits)
    assert_close(_np(outs["fused"].logits), _np(outs["ref"].logits), dtype, "logits vs HF")
    grads = {name: {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
             for name, m in (("ref", ref), ("unfused", unfused), ("fused", fused))}
    assert grads["fused"].keys() == grads["ref"].keys() and grads["fused"]
    for n, g in grads["fused"].items():
        assert g is not None, n
        assert_close(_np(g), _np(grads["ref"][n]), dtype, f"LoRA grad {n} vs HF", reduced_over=BATCH * SEQ)
        if dtype == "float32":
            assert torch.equal(g, grads["unfused"][n]), n


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.parametrize("route", ["inductor", "kernels"])
def test_fused_residual_add_compiles(route):
    """torch.compile traces the rewritten forward (its globals are its module's, the fused call a
    closure variable). The LoRA model's norms are frozen: with ``compile_frozen_with("kernels")``
    the fused kernel runs inside the compiled graph, by default the compiler generates the norms and
    no normkit kernel runs. Outputs and LoRA gradients equal the eager fused model's within the
    tolerance table."""
    torch._dynamo.reset()
    base = _tiny_causal_lm("LlamaForCausalLM", "LlamaConfig", seed=43)
    eager = _lora(base)
    tf.patch_model(eager, fuse_residual_add=True)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    ids = _tokens(44)
    previous = tf.compile_frozen_with(route)
    try:
        with normkit.record_launches() as log:
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
    finally:
        tf.compile_frozen_with(previous)
    if route == "kernels":
        assert sum(launch.flags["HAS_RESIDUAL"] for launch in log.of("norm_fwd_kernel")) == LAYERS
    else:
        assert log.kernels() == [], log.kernels()
    ref = eager(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert_close(_np(out.logits), _np(ref.logits), "float32", "compiled logits")
    trained = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad}
    assert trained
    for n, p in compiled_model.named_parameters():
        if p.requires_grad:
            assert_close(_np(p.grad), _np(trained[n]), "float32", f"compiled LoRA grad {n}", reduced_over=BATCH * SEQ)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # Inductor's advice on fp32 matmuls
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")  # torch 2.11's graph-tree memory pool
@pytest.mark.parametrize("route", ["inductor", "kernels"])
def test_peft_lora_model_trains_under_cuda_graphs(route):
    """A PEFT LoRA Llama with normkit's norms under ``torch.compile(mode="reduce-overhead")``: every
    graph runs as a CUDA graph (no skip), and three training steps (AdamW over the LoRA parameters)
    give the eager patched model's losses and LoRA gradients, step by step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _lora(_tiny("llama", seed=71)).cuda()
    tf.patch_model(eager)
    compiled_model = copy.deepcopy(eager)
    models = {"eager": (eager, eager), "compiled": (compiled_model, torch.compile(compiled_model, mode="reduce-overhead"))}
    ids = _tokens(72).cuda()
    history = {}
    previous = tf.compile_frozen_with(route)
    try:
        for name, (model, run) in models.items():
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-2)
            history[name] = []
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                loss = run(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                history[name].append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.requires_grad}))
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        tf.compile_frozen_with(previous)
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor ran a graph without CUDA graphs"
    for step, ((loss, grads), (want_loss, want)) in enumerate(zip(history["compiled"], history["eager"])):
        assert_close(loss, want_loss, "float32", f"step {step} loss")
        assert grads.keys() == want.keys() and grads
        for n, g in grads.items():
            assert_close(_np(g), _np(want[n]), "float32", f"step {step} LoRA grad {n}", reduced_over=BATCH * SEQ)
    assert all(m.weight.grad is None for m in compiled_model.modules() if isinstance(m, tf.RMSNorm))
    torch._dynamo.reset()


def test_fused_residual_add_unpatches_and_survives_deepcopy():
    model = _tiny("llama", seed=51)
    report = tf.patch_model(model, fuse_residual_add=True)
    assert len(report.fused) == LAYERS
    twin = copy.deepcopy(model)
    assert all("forward" in layer.__dict__ for layer in twin.model.layers)
    assert len(tf.patch_model(model, fuse_residual_add=True).fused) == 0  # fused already: nothing to do
    restored = tf.unpatch_model(model)
    assert len(restored.fused) == LAYERS and "unfused" in str(restored)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    assert not any(isinstance(m, HFRMSNorm) for m in model.modules())


def test_fuse_residual_add_leaves_other_layers_alone():
    """A layer is rewritten only when its forward has the three statements, once, and its
    post-attention norm is normkit's; anything else is listed with the reason."""
    gemma = _tiny("gemma", seed=61)  # Gemma's layers: the same statements (with its own norms)
    rep = tf.patch_model(gemma, fuse_residual_add=True)
    assert len(rep.fused) == LAYERS, str(rep)

    not_swapped = _tiny("llama", seed=62)
    rep = tf.patch_model(not_swapped, rms_norm=False, fuse_residual_add=True)
    assert not rep.fused and sum("not normkit's RMSNorm" in why for _, _, why in rep.skipped) == LAYERS

    class Layer(nn.Module):  # the attributes of a decoder layer, another forward
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = nn.Identity(), nn.Linear(8, 8)
            self.post_attention_layernorm = nn.RMSNorm(8)

        def forward(self, hidden_states):
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            return residual + self.mlp(hidden_states)

    model = nn.Sequential(Layer())
    rep = tf.patch_model(model, fuse_residual_add=True)
    assert not rep.fused and any("exactly once" in why for _, _, why in rep.skipped), str(rep)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), Layer.forward(model[0], x))


def test_fused_add_norm_falls_back_where_the_kernel_would_change_the_result():
    """The fused layers' add + norm: one fused kernel for normkit's RMSNorm when the output keeps x's
    dtype; the original two steps otherwise (a wider weight promotes HF's output to fp32, which the
    kernel's x.dtype output would not; a norm that is not normkit's), bitwise what they compute."""
    from torch_frontend.patch import _add_norm

    gen = torch.Generator().manual_seed(91)
    h, r = (torch.randn(2, 5, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN, generator=gen)
    for norm_weight, norm, fused in ((weight.to(torch.bfloat16), HFRMSNorm(HIDDEN), True),
                                     (weight, HFRMSNorm(HIDDEN), False),
                                     (weight.to(torch.bfloat16), nn.RMSNorm(HIDDEN, dtype=torch.bfloat16), False)):
        norm.weight.data = norm_weight.clone()  # random, in the dtype under test
        with normkit.record_launches() as log:
            y, s = _add_norm(norm, h, r)
        assert torch.equal(s, r + h)
        assert torch.equal(y, norm(r + h)) and y.dtype == norm(r + h).dtype
        assert any(launch.flags.get("HAS_RESIDUAL") for launch in log.of("norm_fwd_kernel")) == fused


def test_fuse_residual_add_skips_a_layer_whose_forward_was_replaced():
    model = _tiny("llama", seed=81)
    layer = model.model.layers[0]
    layer.forward = layer.forward  # an instance attribute, as accelerate's hooks leave it
    report = tf.patch_model(model, fuse_residual_add=True)
    assert [name for name, _ in report.fused] == ["model.layers.1"]
    assert any(name == "model.layers.0" and "replaced on the instance" in why for name, _, why in report.skipped)


# ---------------------------------------------------------------------------------------------
# QK-norm fused into the rotary embedding (qk_norm_rope=True): Qwen3 and Gemma 3 attention.

QK_ARCHS = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig")}


def _tiny_qk(kind: str, seed: int, *, frozen_norms: bool = True):
    """A 2-layer model of ``kind`` (hidden 64, 4 heads, 2 kv heads, head_dim 16), its norms random and
    (by default) frozen."""
    torch.manual_seed(seed)
    model_cls, config_cls = QK_ARCHS[kind]
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, max_position_embeddings=64)
    model = getattr(transformers, model_cls)(cfg)
    _randomize_norms(model, torch.Generator().manual_seed(seed + 1))
    if frozen_norms:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.requires_grad_(False)
    return model


def _attentions(model) -> list:
    return [m for m in model.modules() if hasattr(m, "q_norm") and hasattr(m, "k_norm")]


def _assert_trained_grads_match(model, ref) -> None:
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        assert p.grad is not None, name
        assert_close(_np(p.grad), _np(ref_params[name].grad), "float32", f"grad {name}", reduced_over=BATCH * SEQ)
    assert any(np.abs(_np(p.grad)).max() > 0 for n, p in trained if "q_proj" in n)  # a comparison that can fail


@pytest.mark.parametrize("kind", sorted(QK_ARCHS))
def test_qk_norm_rope_matches_the_unpatched_model(kind):
    """Frozen norms, everything else trained: one rms_norm_rope launch for q and one for k in each
    layer, and no separate q/k norm; logits and every trained parameter's gradient as HF's own
    model's. Generation (eval, no_grad, KV cache) gives HF's tokens. unpatch_model puts the class's
    forward back: the logits are then HF's bitwise."""
    ref = _tiny_qk(kind, seed=61)
    model = copy.deepcopy(ref)
    report = tf.patch_model(model, qk_norm_rope=True)
    attns = _attentions(model)
    assert len(attns) == LAYERS and all(cls is type(attns[0]) for _, cls in report.qk_fused)
    assert {name for name, _ in report.qk_fused} == {n for n, m in model.named_modules() if m in attns}
    assert "q_norm/k_norm + apply_rotary_pos_emb -> rms_norm_rope" in str(report) and not report.skipped

    out_ref, out, log = _step_both(ref, model, 62)
    assert len(log.of("rms_norm_rope_fwd_kernel")) == len(log.of("rms_norm_rope_bwd_kernel")) == 2 * LAYERS
    assert len(log.of("norm_fwd_kernel")) == len(report.patched) - 2 * LAYERS  # q_norm, k_norm: fused instead
    if kind == "qwen3":  # frozen, safe weights (offset 0): the backward recovers x from the output
        assert all(launch.flags["STORE_REC"] for launch in log.of("rms_norm_rope_fwd_kernel"))
    assert_close(_np(out.logits), _np(out_ref.logits), "float32", "logits")
    _assert_trained_grads_match(model, ref)

    ref.eval(), model.eval()
    ids = _tokens(63)[:, :5]
    with torch.no_grad():
        gen_ref = ref.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
        with normkit.record_launches() as log:
            gen = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert len(log.of("rms_norm_rope_fwd_kernel")) == 3 * 2 * LAYERS  # a prefill and two cached steps
    assert gen.shape == (BATCH, 8) and torch.equal(gen, gen_ref), (gen, gen_ref)

    forward = type(attns[0]).forward
    restored = tf.unpatch_model(model)
    assert len(restored.qk_fused) == LAYERS and "unfused" in str(restored)
    assert all("forward" not in m.__dict__ and type(m).forward is forward for m in _attentions(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


# Gemma 3's attention (norms with an offset) meets the rewrite in the default run of the test above;
# under LoRA (PEFT's wrapping, the same for both) it is the slow tier.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "qwen3" else pytest.mark.slow)
                                  for k in sorted(QK_ARCHS)])
def test_qk_norm_rope_under_lora(kind):
    """PEFT LoRA on q_proj and v_proj, patched after PEFT wrapped the model: the LoRA gradients are
    HF's own model's."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    ref = peft.get_peft_model(_tiny_qk(kind, seed=71), cfg)
    model = copy.deepcopy(ref)
    report = tf.patch_model(model, qk_norm_rope=True)
    assert len(report.qk_fused) == LAYERS, str(report)
    _, _, log = _step_both(ref, model, 72)
    # layer 0's k needs no gradient: k_proj is frozen and its input is the frozen embedding's output
    assert len(log.of("rms_norm_rope_bwd_kernel")) == 2 * LAYERS - 1
    assert not any(launch.flags["COMPUTE_DW"] for launch in log.of("rms_norm_rope_bwd_kernel"))
    _assert_lora_grads_match(model, ref)


def test_qk_norm_rope_is_the_default_and_skips_what_it_cannot_fuse():
    """On by default (qk_norm_rope=False turns it off); with the q/k norms left as HF's
    (rms_norm=False), or an attention whose forward does not have the expected structure, the
    attention is left alone and the report says why."""
    model = _tiny_qk("qwen3", seed=81)
    assert len(tf.patch_model(copy.deepcopy(model)).qk_fused) == LAYERS
    assert not tf.patch_model(copy.deepcopy(model), qk_norm_rope=False).qk_fused
    report = tf.patch_model(copy.deepcopy(model), rms_norm=False)
    assert not report.qk_fused and "not normkit's RMSNorm; QK-norm and RoPE not fused" in str(report)

    attn_cls = type(_attentions(model)[0])

    class Reordered(attn_cls):  # the rotary embedding before k_norm: not the structure the rewrite expects
        def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
            hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821
            key_states = self.k_norm(key_states)
            return query_states, key_states

    layer = model.model.layers[0]
    layer.self_attn.__class__ = Reordered
    report = tf.patch_model(model, qk_norm_rope=True)
    assert [n for n, _ in report.qk_fused] == ["model.layers.1.self_attn"], str(report)
    assert any(n == "model.layers.0.self_attn" and "self.k_norm" in why for n, _, why in report.skipped), str(report)
    assert "forward" not in layer.self_attn.__dict__


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
def test_qk_norm_rope_compiles():
    """torch.compile traces the rewritten attention with fullgraph=True (aot_eager: CPU Inductor is slow
    to compile a whole model): the frozen plain norms run as torch operations (no normkit kernel), the
    fused QK-norm + RoPE as its kernels (one forward and one backward launch for each of q and k per
    layer), and the logits and gradients are the eager patched model's."""
    torch._dynamo.reset()
    eager = _tiny_qk("qwen3", seed=91)
    assert len(tf.patch_model(eager, qk_norm_rope=True).qk_fused) == LAYERS
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    ids = _tokens(92)
    with normkit.record_launches() as log:
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
    launched = log.kernels()
    assert sorted(launched) == ["rms_norm_rope_bwd_kernel"] * 2 * LAYERS + ["rms_norm_rope_fwd_kernel"] * 2 * LAYERS, \
        launched
    ref = eager(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert_close(_np(out.logits), _np(ref.logits), "float32", "compiled logits")
    _assert_trained_grads_match(compiled_model, eager)
    torch._dynamo.reset()
