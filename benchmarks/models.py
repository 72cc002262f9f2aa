"""The Llama (or Qwen3) + LoRA model of the benchmarks, scripts and notebooks, built once here.

``llama_lora`` builds a random-init ``transformers`` Llama, or with ``arch="qwen3"`` a Qwen3 (QK-norm:
RMSNorm over each head's 128 columns of q and k, before the rotary embedding), nothing downloaded, on the device and in
the dtype asked for, wraps it in a PEFT LoRA adapter (default r=16, alpha 32, dropout 0, on
q_proj/k_proj/v_proj/o_proj: every base weight and every norm weight frozen), and gives it the norms
asked for (``swap_norms``):

- ``hf``: transformers' ``LlamaRMSNorm``, unchanged;
- ``normkit``: ``torch_frontend.patch_model(model, qk_norm_rope=False)``: normkit's norms, HF's rotation;
- ``normkit_fused``: ``patch_model(model, fuse_residual_add=True)``: also each decoder layer's residual
  add before ``post_attention_layernorm`` fused into that norm;
- ``normkit_rope``: ``patch_model(model)`` (``qk_norm_rope=True``, the default): also each Qwen3 attention's q_norm/k_norm
  and rotary embedding run as one ``rms_norm_rope`` for q and one for k;
- ``liger``: every ``LlamaRMSNorm`` (``Qwen3RMSNorm``) replaced by ``liger_kernel.transformers.LigerRMSNorm`` carrying the
  HF module's eps and weight ``Parameter``, configured as Liger's own Llama patch configures it (offset
  0, casting "llama", in_place=True). Not ``apply_liger_kernel_to_llama``: it also rebinds
  ``transformers.models.llama.modeling_llama.LlamaRMSNorm`` process-wide (changing every other model of
  the process) and, given ``model=``, expects an unwrapped Llama, not a PEFT model. Only the norm is
  swapped; no other Liger kernel (RoPE, SwiGLU, loss) is applied.

The norm weights are drawn from U(0.5, 1.5) instead of HF's ones, so that a norm that dropped its
weight shows in the loss.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import warnings

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR_TARGETS = LORA_TARGETS + ("gate_proj", "up_proj", "down_proj")  # PEFT's "all-linear" for a Llama
# normkit_input: normkit with save="input", the control of what keeping the output saves; normkit_apart:
# normkit without sharing its output's copy with LoRA layers in another dtype (share_adapter_copy=False);
# normkit_convert: normkit whose shared copy is converted by y.to, not written by the forward kernel
# (benchmarks/lora_step.py turns the kernel's copy off around its steps)
NORMS = ("hf", "normkit", "normkit_fused", "normkit_input", "normkit_apart", "normkit_convert", "normkit_rope",
         "liger")
ARCHS = ("llama", "qwen3", "gemma3")
_HF_NORMS = ("LlamaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm")
# the attention modules whose QK-norm patch_model(qk_norm_rope=True) fuses with the rotary embedding
_QK_NORM_ATTENTIONS = ("Qwen3Attention", "Gemma3Attention")


class Unavailable(Exception):
    """A norm variant that cannot run here; the message is the reason."""


def llama_lora(*, layers: int, hidden: int, heads: int, vocab: int, intermediate: int | None = None,
               kv_heads: int | None = None, max_positions: int = 2048, dtype: torch.dtype = torch.float32,
               device="cpu", seed: int = 0, norms: str = "hf", r: int = 16, alpha: int | None = None,
               targets=LORA_TARGETS, init_lora_weights: bool = True, attn_implementation: str | None = None,
               adapter_dtype: str = "float32", arch: str = "llama", head_dim: int | None = None):
    """``(model, info)``: the LoRA-wrapped Llama (``arch="qwen3"``: Qwen3; ``"gemma3"``: Gemma 3's text
    model, whose norms scale by ``1 + w`` in fp32) with ``norms``, and
    ``swap_norms``' account of them.

    ``intermediate`` defaults to Llama's 11008 / 4096 of ``hidden`` (64-aligned), ``kv_heads`` to
    ``heads``, ``alpha`` to ``2 * r``, ``head_dim`` to ``hidden / heads`` (Qwen3 and Gemma 3: 128; Gemma 3
    attends to a sliding window of 4096 tokens in five layers of six, as its config's default). ``init_lora_weights=False`` draws B at random too (PEFT's default
    starts it at zero), so that every LoRA gradient is non-zero from the first step.

    ``adapter_dtype``: ``"float32"`` (PEFT's default, ``autocast_adapter_dtype=True``: a bf16 or fp16
    model's adapters are fp32, and each adapter keeps an fp32 copy of its input for the backward, not the
    input itself) or ``"model"`` (``autocast_adapter_dtype=False``: the adapters in the model's dtype keep
    their input, the norm's output, itself). Which one decides what a norm that keeps its output saves:
    only with ``"model"`` is that output alive anyway, so that the norm's input is freed at no cost."""
    if adapter_dtype not in ("float32", "model"):
        raise ValueError(f"adapter_dtype must be 'float32' or 'model', not {adapter_dtype!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    import peft
    import transformers

    if intermediate is None:
        intermediate = max(64, round(hidden * 11008 / 4096 / 64) * 64)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=max_positions,
        use_cache=False, **({"attn_implementation": attn_implementation} if attn_implementation else {}))
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=head_dim or 128, **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(head_dim=head_dim or 128, query_pre_attn_scalar=head_dim or 128,
                                               **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.LlamaConfig(**({"head_dim": head_dim} if head_dim else {}), **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # built where it runs, in its dtype: no fp32 CPU copy first
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for _, module in norm_modules(model):
            module.weight.uniform_(0.5, 1.5)
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, lora_dropout=0.0,
                           target_modules=list(targets), init_lora_weights=init_lora_weights, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft 0.21 reads transformers' deprecated is_gradient_checkpointing; harmless here.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype == "float32")
    model.train()
    return model, swap_norms(model, norms)


def norm_modules(model) -> list:
    """``(name, module)`` of every RMSNorm of ``model``, whichever implementation."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


def swap_norms(model, norms: str) -> dict:
    """Give ``model`` (a Llama or Qwen3, LoRA-wrapped or not) the norms of ``norms`` in place; returns how
    (``how``, and for normkit the patch report and its counts). Raises ``Unavailable`` with the reason
    when the variant cannot run here."""
    if norms == "hf":
        return {"how": "transformers' LlamaRMSNorm, unchanged"}
    if norms in ("normkit", "normkit_fused", "normkit_input", "normkit_apart", "normkit_convert", "normkit_rope"):
        out = _patch_normkit(model, fuse_residual_add=norms == "normkit_fused",
                             save="input" if norms == "normkit_input" else "auto", share=norms != "normkit_apart",
                             qk_norm_rope=norms == "normkit_rope")
        if norms == "normkit_convert":
            out["how"] += ", the forward kernel's copy off: each shared copy converted by y.to"
        return out
    if norms == "liger":
        return _swap_liger(model)
    raise ValueError(f"unknown norms {norms!r}; expected one of {NORMS}")


def _patch_normkit(model, fuse_residual_add: bool, save: str = "auto", share: bool = True,
                   qk_norm_rope: bool = False) -> dict:
    import torch_frontend

    hf_norms = sum(type(m).__name__ in _HF_NORMS for _, m in norm_modules(model))
    layers = sum(type(m).__name__.endswith("DecoderLayer") for m in model.modules())
    attentions = sum(type(m).__name__ in _QK_NORM_ATTENTIONS for m in model.modules())
    report = torch_frontend.patch_model(model, fuse_residual_add=fuse_residual_add, save=save,
                                        share_adapter_copy=share, qk_norm_rope=qk_norm_rope)
    if (len(report.patched) != hf_norms or len(report.fused) != (layers if fuse_residual_add else 0)
            or len(report.qk_fused) != (attentions if qk_norm_rope else 0)):
        raise RuntimeError(f"patch_model swapped {len(report.patched)} of {hf_norms} RMSNorm modules, fused "
                           f"{len(report.fused)} of {layers} decoder layers and {len(report.qk_fused)} of "
                           f"{attentions} QK-norm attentions:\n{report}")
    how = ("torch_frontend.patch_model(model" + (", fuse_residual_add=True" if fuse_residual_add else "")
           + ("" if qk_norm_rope else ", qk_norm_rope=False")
           + (f", save={save!r}" if save != "auto" else "") + ("" if share else ", share_adapter_copy=False") + ")")
    return {"how": how, "patch_report": str(report), "patched": len(report.patched),
            "skipped": len(report.skipped), "fused": len(report.fused), "qk_fused": len(report.qk_fused),
            "shares": len(report.shares)}


def _swap_liger(model) -> dict:
    try:
        from liger_kernel.transformers import LigerRMSNorm
    except Exception as e:  # noqa: BLE001 (whatever the import raises, the row says why)
        raise Unavailable(f"liger_kernel.transformers does not import ({type(e).__name__}: {e})") from None
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise Unavailable(f"Liger's Triton kernels need a GPU; this model is on {device.type}")
    signature = inspect.signature(LigerRMSNorm.__init__)
    swapped = 0
    for name, old in norm_modules(model):
        if type(old).__name__ not in _HF_NORMS:
            continue
        gemma = type(old).__name__ == "Gemma3RMSNorm"  # x_hat * (1 + w), computed in fp32 (Liger's "gemma")
        wanted = {"offset": 1.0 if gemma else 0.0, "casting_mode": "gemma" if gemma else "llama", "in_place": True,
                  "row_mode": None}
        kwargs = {k: v for k, v in wanted.items() if k in signature.parameters}
        eps = old.eps if gemma else old.variance_epsilon
        new = LigerRMSNorm(old.weight.shape[0], eps=float(eps), **kwargs)
        new.weight = old.weight  # the very Parameter: dtype, device, requires_grad=False all kept
        new.train(old.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        swapped += 1
    if not swapped:
        raise Unavailable(f"no {' or '.join(_HF_NORMS)} found to replace")
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"how": f"module swap: {swapped} x {'/'.join(_HF_NORMS)} -> liger_kernel.transformers.LigerRMSNorm("
                   f"hidden, eps=<the module's>, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) carrying "
                   "the HF module's weight Parameter (not apply_liger_kernel_to_llama: see benchmarks/models.py)",
            "liger_version": version, "LigerRMSNorm_signature": str(signature)}
