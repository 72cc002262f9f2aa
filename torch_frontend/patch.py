"""Swap the norm modules of an existing model for normkit's, in place.

    >>> model = get_peft_model(LlamaForCausalLM(config), LoraConfig(...))
    >>> report = torch_frontend.patch_model(model)
    >>> print(report)            # what was swapped, what was left alone and why

The new module takes over the old one's ``weight`` (and ``bias``) *Parameter objects*, so dtype,
device, ``requires_grad``, optimizer state and PEFT's freezing all carry over unchanged. A frozen
weight then runs the dW-free backward (``COMPUTE_DW=False``: no fp32 partials, no reduction launch).

Known classes and how each maps onto normkit:

===============================================  ===========  ========  =========================
class                                            normkit      offset    casting_mode
===============================================  ===========  ========  =========================
transformers Llama, Mistral, Mixtral, Qwen2,     HFRMSNorm    0         "llama" (x_hat rounded to
Qwen2Moe, Qwen3, Qwen3Moe, Phi3 ``*RMSNorm``                            x.dtype, then ``w *``)
transformers Gemma, Gemma2, Gemma3 ``*RMSNorm``  RMSNorm      1         "gemma" (fp32 ``1 + w``)
``torch.nn.RMSNorm``                             RMSNorm      0         "gemma" (torch's fused path)
``torch.nn.LayerNorm``                           LayerNorm    n/a       fp32, as torch
===============================================  ===========  ========  =========================

A class is matched by identity when its defining module is already imported, and by name (with a
check of the attributes it must have) otherwise; nothing here imports a model file. Anything else
whose class name contains "Norm" is left as it is and listed in the report with a reason.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Callable, Optional, Union

import torch
from torch import nn

from normkit.ops import FUSED_ADD_RMS_NORM, MAX_N
from normkit.patch_report import PatchReport as _PatchReport
from normkit.patch_report import listed
from normkit.checks import check_save
from torch_frontend import _compat
from torch_frontend import functional as F
from torch_frontend._save import SaveDecision, save_decision
from torch_frontend.modules import FusedAddRMSNorm, LayerNorm, RMSNorm

__all__ = ["patch_model", "unpatch_model", "PatchReport", "HFRMSNorm"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ORIGINAL = "_normkit_original"  # instance attribute of a patched module: the module it replaced


class HFRMSNorm(RMSNorm):
    """normkit's RMSNorm standing in for transformers' Llama-style ``*RMSNorm``.

    Same math as ``RMSNorm(casting_mode="llama")``, plus two things the original has:

    - ``variance_epsilon``, an alias of ``eps``, for code that reads it;
    - the output dtype of ``weight * x_hat.to(x.dtype)``, i.e. ``promote_types(weight.dtype, x.dtype)``.
      When the weight is wider than x (fp32 weight, bf16 x) the kernel's x.dtype result is cast up,
      so it carries one extra rounding to x.dtype that the original does not.
    """

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.weight is not None:
            out_dtype = torch.promote_types(self.weight.dtype, x.dtype)
            if out_dtype != y.dtype:
                y = y.to(out_dtype)
        return y


_NORMKIT_CLASSES = (RMSNorm, LayerNorm, FusedAddRMSNorm)


# ---------------------------------------------------------------------------------------------
# Converters: old module -> new normkit module, or a string saying why it is left alone.


def _check_param(p, name: str) -> Optional[str]:
    if p is None:
        return None
    if not isinstance(p, torch.Tensor):
        return f"{name} is a {type(p).__name__}, not a tensor"
    if p.dim() != 1:
        return f"{name} has shape {tuple(p.shape)}; normkit normalizes over one last dimension"
    if not 1 <= p.shape[0] <= MAX_N:
        return f"{name} has {p.shape[0]} elements; normkit supports 1..{MAX_N}"
    if p.dtype not in _SUPPORTED_DTYPES:
        return f"{name} has dtype {p.dtype}; normkit supports float32, bfloat16 and float16"
    return None


def _rms_like(old: nn.Module, cls, eps_attr: str, offset: float, casting: str) -> Union[nn.Module, str]:
    weight = getattr(old, "weight", None)
    eps = getattr(old, eps_attr, None)
    if not isinstance(weight, nn.Parameter):
        return "no `weight` Parameter where this class keeps one"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"no numeric `{eps_attr}` where this class keeps its eps"
    bad = _check_param(weight, "weight")
    if bad:
        return bad
    # Built on the meta device so nothing is allocated; the old Parameter is then adopted as is.
    new = cls(weight.shape[0], float(eps), True, offset=offset, casting_mode=casting, device="meta",
              dtype=weight.dtype)
    new.weight = weight
    return new


def _hf_llama(old):
    return _rms_like(old, HFRMSNorm, "variance_epsilon", 0.0, "llama")


def _hf_gemma(old):
    # Gemma scales by (1 + weight) in fp32 and rounds once at the end; its weight starts at zero.
    return _rms_like(old, RMSNorm, "eps", 1.0, "gemma")


def _torch_rms_norm(old: nn.RMSNorm):
    if len(old.normalized_shape) != 1:
        return f"normalized_shape {tuple(old.normalized_shape)} spans several dims; normkit normalizes the last one"
    bad = _check_param(old.weight, "weight")
    if bad:
        return bad
    # eps=None: torch documents finfo(x.dtype).eps, but computes in float32 for fp32/bf16/fp16 inputs and
    # adds finfo(float32).eps (see torch._decomp's _fused_rms_norm). Those are the only dtypes normkit
    # takes, so the faithful value is that constant.
    eps = torch.finfo(torch.float32).eps if old.eps is None else float(old.eps)
    # With matching dtypes torch runs its fused kernel: everything in fp32, one rounding at the end.
    new = RMSNorm(old.normalized_shape, eps, old.elementwise_affine, offset=0.0, casting_mode="gemma",
                  device="meta", dtype=old.weight.dtype if old.weight is not None else None)
    if old.weight is not None:
        new.weight = old.weight
    return new


def _torch_layer_norm(old: nn.LayerNorm):
    if len(old.normalized_shape) != 1:
        return f"normalized_shape {tuple(old.normalized_shape)} spans several dims; normkit normalizes the last one"
    for name in ("weight", "bias"):
        bad = _check_param(getattr(old, name), name)
        if bad:
            return bad
    dtype = old.weight.dtype if old.weight is not None else None
    new = LayerNorm(old.normalized_shape, old.eps, old.elementwise_affine, bias=old.bias is not None,
                    device="meta", dtype=dtype)
    if old.weight is not None:
        new.weight = old.weight
    if old.bias is not None:
        new.bias = old.bias
    elif old.elementwise_affine:
        new.register_parameter("bias", None)
    return new


_HF_LLAMA_STYLE = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"]
_HF_GEMMA_STYLE = ["gemma", "gemma2", "gemma3"]
_CAMEL = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}


def _hf(model_type: str) -> tuple[str, str]:
    camel = _CAMEL.get(model_type, model_type.capitalize())
    return f"transformers.models.{model_type}.modeling_{model_type}", f"{camel}RMSNorm"


# (defining module, class name) -> converter
KNOWN: dict[tuple[str, str], Callable] = {
    **{_hf(t): _hf_llama for t in _HF_LLAMA_STYLE},
    **{_hf(t): _hf_gemma for t in _HF_GEMMA_STYLE},
    ("torch.nn.modules.normalization", "RMSNorm"): _torch_rms_norm,
    ("torch.nn.modules.normalization", "LayerNorm"): _torch_layer_norm,
}


def _converter(cls: type) -> tuple[Optional[Callable], Optional[str]]:
    """(converter, None) for a known class; (None, reason) for a norm-looking unknown one."""
    if issubclass(cls, _NORMKIT_CLASSES):
        return None, "already a normkit module"
    namesake = None
    for (modpath, name), conv in KNOWN.items():
        if cls.__name__ != name:
            continue
        mod = sys.modules.get(modpath)
        if mod is None:
            return conv, None  # by name: the converter checks the attributes it relies on
        if getattr(mod, name, None) is cls:
            return conv, None  # by identity
        namesake = f"{modpath}.{name}"
    if namesake is not None:
        return None, f"named like {namesake} but defined in {cls.__module__}; not known"
    for (modpath, name), _ in KNOWN.items():
        known = getattr(sys.modules.get(modpath), name, None)
        if isinstance(known, type) and issubclass(cls, known):
            return None, f"a subclass of {modpath}.{name}, whose forward may differ; not known"
    return None, "not a class normkit knows"


def _looks_like_norm(cls: type) -> bool:
    return "norm" in cls.__name__.lower()


def _has_hooks(m: nn.Module) -> Optional[str]:
    if "forward" in m.__dict__:
        return "its forward was replaced on the instance (e.g. by an accelerate hook); patch before dispatching"
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        if getattr(m, attr, None):
            return f"it has {attr.strip('_').replace('_', ' ')} registered, which a swap would drop"
    return None


# ---------------------------------------------------------------------------------------------
# The report.


@dataclasses.dataclass
class PatchReport(_PatchReport):
    """What ``patch_model`` (or ``unpatch_model``) did.

    ``patched``: ``(qualified name, old class, new class)`` for each swapped module.
    ``skipped``: ``(qualified name, class, reason)`` for each norm-looking module left as it was.
    ``fused``: ``(name, class)`` of the decoder layers whose residual add was fused.
    ``qk_fused``: ``(name, class)`` of the attention modules whose QK-norm and rotary embedding were fused.
    ``saves``: ``(name, SaveDecision)`` of each patched norm: whether, frozen, its backward keeps the
    output (save="auto": decided for its current weight and inputs of the weight's dtype) and why.
    ``shares``: ``(name, LoRA layers, their dtype)`` of each norm whose output PEFT LoRA layers take in
    another dtype, found when patching (``share_adapter_copy``); ``casts``: on ``unpatch_model``, how
    many LoRA layers got PEFT's own conversion back.
    """

    fused: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    qk_fused: list = dataclasses.field(default_factory=list)
    shares: list = dataclasses.field(default_factory=list)
    casts: int = 0

    def extra_lines(self) -> list:
        lines = []
        for modules, fused, apart in (
                (self.qk_fused, "q_norm/k_norm + apply_rotary_pos_emb -> rms_norm_rope",
                 "its own forward again (QK-norm and rotary embedding apart)"),
                (self.fused, "residual add + post_attention_layernorm -> fused_add_rms_norm",
                 "its own forward again (residual add and norm apart)")):
            by_class: dict = {}
            for name, cls in modules:
                by_class.setdefault(cls.__name__, []).append(name)
            what = fused if self.verb == "patched" else apart
            for cls, names in by_class.items():
                lines.append(f"  {'fused' if self.verb == 'patched' else 'unfused'} {len(names):3d} x {cls}: {what}: "
                             f"{listed(names)}")
        if self.saves:
            outputs = [name for name, d in self.saves if d.saves_output]
            lines.append(f"  backward keeps the output (not the input) in {len(outputs)} of {len(self.saves)} "
                         "patched norm(s) when frozen")
            kept: dict = {}
            for name, d in self.saves:
                if not d.saves_output:
                    kept.setdefault(d.reason, []).append(name)
            for reason, names in kept.items():
                lines.append(f"  keeps the input {len(names):3d} x ({reason}): {listed(names)}")
        by_takers: dict = {}
        for name, takers, dtype in self.shares:
            by_takers.setdefault((len(takers), dtype), []).append(name)
        for (n, dtype), names in by_takers.items():
            lines.append(f"  shares  {len(names):3d} x its output's {str(dtype).replace('torch.', '')} copy with {n} LoRA "
                         f"layer(s) each (one conversion, one tensor kept): {listed(names)}")
        if self.casts:
            lines.append(f"  restored PEFT's own input conversion in {self.casts} LoRA layer(s)")
        return lines


# ---------------------------------------------------------------------------------------------
# Fusing a decoder layer's residual add into its post-attention norm (fuse_residual_add=True).
#
# The layer's own ``forward`` source is rewritten: the three statements below become one call of
# ``_add_norm``, and the function is compiled again in its module's namespace with its decorators.
# Everything else in it (signature, decorators, the attention call, the MLP) is the original code.
# A forward that does not contain the three statements exactly, once, at its top level is not
# touched. The rewritten forward is set on the instance, so unpatch_model can delete it.

_FUSED = "_normkit_fused_forward"  # marks a rewritten forward
_ADD_NORM_SOURCE = """
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
"""
_FUSED_SOURCE = "hidden_states, residual = _normkit_add_norm(self.post_attention_layernorm, hidden_states, residual)"


def _add_norm(norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor):
    """``(norm(residual + hidden_states), residual + hidden_states)``: one fused kernel when ``norm``
    is normkit's RMSNorm and the output keeps x's dtype; otherwise the original two steps."""
    if isinstance(norm, RMSNorm) and hidden_states.dtype == residual.dtype and hidden_states.shape == residual.shape:
        w = norm.weight
        if w is None or torch.promote_types(w.dtype, hidden_states.dtype) == hidden_states.dtype:
            return F._apply(FUSED_ADD_RMS_NORM, hidden_states, residual, w, None, norm.eps, norm.offset,
                            norm.casting_mode, norm.save, norm.save_hint, norm._copy(hidden_states))
    hidden_states = residual + hidden_states
    return norm(hidden_states), hidden_states


def _recompiled(cls: type, edit: Callable, helper_name: str, helper: Callable, marker: str):
    """``cls.forward`` recompiled from its source after ``edit(func)`` changed its ``ast.FunctionDef`` in
    place (``edit`` returns None, or the reason it cannot), with ``helper`` reachable under
    ``helper_name``; the new function carries ``marker``. Or the reason there is none."""
    import ast
    import inspect
    import textwrap

    fn = cls.forward
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return "its forward's source is not available"
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef):
        return "its forward is not a plain function"
    if any(isinstance(n, ast.Name) and n.id == "super" for n in ast.walk(func)):
        return "its forward calls super(), which a recompiled copy cannot"
    reason = edit(func)
    if reason is not None:
        return reason
    inner = inspect.unwrap(fn)  # the function its decorators wrap: the source's own lines and file
    ast.increment_lineno(func, inner.__code__.co_firstlineno - 1)  # tracebacks name the original lines
    module = sys.modules.get(fn.__module__)
    if module is None:
        return "its forward's module is not imported"
    # The new forward's globals are its module's own (torch.compile resolves a function's globals
    # through its module), and the helper reaches it as a closure variable of a factory, so nothing
    # is added to the module.
    factory = ast.parse(f"def _normkit_factory({helper_name}):\n    return {func.name}").body[0]
    factory.body.insert(0, func)
    tree.body = [factory]
    code = compile(ast.fix_missing_locations(tree), inspect.getsourcefile(inner) or "<normkit>", "exec")
    local: dict = {}
    exec(code, vars(module), local)  # defines the factory only; the decorators run when it is called
    new = local["_normkit_factory"](helper)
    setattr(new, marker, True)
    return new


def _edit_add_norm(func) -> Optional[str]:
    import ast

    want = [ast.dump(st) for st in ast.parse(_ADD_NORM_SOURCE).body]
    body = [ast.dump(st) for st in func.body]
    starts = [i for i in range(len(body) - 2) if body[i:i + 3] == want]
    if len(starts) != 1:
        return ("its forward does not contain `hidden_states = residual + hidden_states; residual = "
                "hidden_states; hidden_states = self.post_attention_layernorm(hidden_states)` exactly once")
    i = starts[0]
    func.body[i:i + 3] = ast.parse(_FUSED_SOURCE).body
    return None


@functools.lru_cache(maxsize=None)
def _rewrite(cls: type):
    """``cls.forward`` with the add and the norm fused (a function), or the reason there is none."""
    return _recompiled(cls, _edit_add_norm, "_normkit_add_norm", _add_norm, _FUSED)


def _fuse_forwards(model: nn.Module, report: PatchReport, done: list, attrs: tuple, norms: tuple, marker: str,
                   rewrite, what: str) -> None:
    """Replace the forward of each module that has ``attrs`` and whose ``norms`` are normkit's RMSNorm
    with ``rewrite(cls)``'s (added to ``done``); else say in ``report.skipped`` why ``what`` was not."""
    for name, module in model.named_modules():
        if not all(hasattr(module, a) for a in attrs):
            continue
        cls = type(module)
        if getattr(module.__dict__.get("forward"), marker, False):
            continue  # fused already
        if "forward" in module.__dict__:
            report.skipped.append((name, cls, f"its forward was replaced on the instance; {what}"))
            continue
        bad = [a for a in norms if not isinstance(getattr(module, a), RMSNorm)]
        if bad:
            report.skipped.append((name, cls, f"its {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not "
                                              f"normkit's RMSNorm; {what}"))
            continue
        new = rewrite(cls)
        if isinstance(new, str):
            report.skipped.append((name, cls, f"{new}; {what}"))
            continue
        module.forward = new.__get__(module, cls)
        done.append((name, cls))


def _fuse_residual_adds(model: nn.Module, report: PatchReport) -> None:
    _fuse_forwards(model, report, report.fused, ("post_attention_layernorm", "self_attn", "mlp"),
                   ("post_attention_layernorm",), _FUSED, _rewrite, "not fused")


# ---------------------------------------------------------------------------------------------
# Fusing an attention's QK-norm into its rotary embedding (qk_norm_rope=True).
#
# Qwen3's and Gemma 3's attention normalize q and k per head (``self.q_norm``, ``self.k_norm``:
# RMSNorm over head_dim) and then rotate them (``apply_rotary_pos_emb(query_states, key_states, cos,
# sin)``). The forward's source is rewritten, as for the residual add: the two norm calls are
# removed, and the rotary call becomes ``_normkit_qk_norm_rope(self, query_states, key_states, cos,
# sin)``, which runs ``rms_norm_rope`` (one pass over q, one over k) with each norm module's weight,
# eps, offset and casting mode. Everything else (the projections, the cache update, the attention
# interface: eager, sdpa or flash; GQA; masks) is the original code. Removing a norm call is sound
# only where nothing but a ``.transpose(1, 2)`` (which leaves the last dimension, the norm's, alone)
# comes between it and the rotary call: the edit checks that, or leaves the forward alone.

_QK_FUSED = "_normkit_qk_norm_rope_forward"  # marks a forward whose QK-norm and rotary embedding are fused
_ROPE_SOURCE = "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
_QK_SOURCE = "query_states, key_states = _normkit_qk_norm_rope(self, query_states, key_states, cos, sin)"
_QK_NORMS = (("query_states", "q_norm"), ("key_states", "k_norm"))


def _norm_rope(norm: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str) -> torch.Tensor:
    """``apply_rotary_pos_emb``'s rotation of ``norm(x)``, in one ``rms_norm_rope``. The result has
    the dtype HF's code gives it: the norm's output dtype (``HFRMSNorm``: promoted with the weight's)
    promoted with the tables'; where that is wider than x's, the fused result (rounded to x's dtype)
    is cast up, one rounding HF's code does not have."""
    from torch_frontend._rope import rms_norm_rope

    if not isinstance(norm, RMSNorm):
        raise TypeError(f"normkit: {name} is a {type(norm).__name__}, not normkit's RMSNorm, but this attention's "
                        "forward was rewritten by patch_model(qk_norm_rope=True) for normkit's; call unpatch_model "
                        "before replacing it")
    out = rms_norm_rope(x, norm.weight, cos, sin, norm.eps, offset=norm.offset, casting_mode=norm.casting_mode,
                        save=norm.save)
    dtype = x.dtype
    if isinstance(norm, HFRMSNorm) and norm.weight is not None:
        dtype = torch.promote_types(norm.weight.dtype, dtype)
    dtype = torch.promote_types(dtype, cos.dtype)
    return out if out.dtype == dtype else out.to(dtype)


def _qk_norm_rope(attn: nn.Module, query_states: torch.Tensor, key_states: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)`` returns (its ``unsqueeze_dim=1``:
    q and k [B, H, S, D], the tables [B, S, D])."""
    for name, t in (("query_states", query_states), ("key_states", key_states)):
        # the rewrite moved the norm past a .transpose(1, 2), which leaves the last dimension in place
        # only from 4 dimensions on
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"normkit: {name} must be a 4-d [B, H, S, D] tensor in an attention rewritten by "
                             f"patch_model(qk_norm_rope=True); got {getattr(t, 'shape', type(t).__name__)}")
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (_norm_rope(attn.q_norm, query_states, cos, sin, "q_norm"),
            _norm_rope(attn.k_norm, key_states, cos, sin, "k_norm"))


def _edit_qk_norm_rope(func) -> Optional[str]:
    import ast

    rope_dump = ast.dump(ast.parse(_ROPE_SOURCE).body[0])
    at = [i for i, st in enumerate(func.body) if ast.dump(st) == rope_dump]
    if len(at) != 1:
        return f"its forward does not contain `{_ROPE_SOURCE}` exactly once at its top level"
    r = at[0]

    def is_norm(node, attr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
                and node.value.id == "self")

    for var, attr in _QK_NORMS:
        uses = [n for n in ast.walk(func) if is_norm(n, attr)]
        stmts = [i for i, st in enumerate(func.body[:r]) if any(is_norm(n, attr) for n in ast.walk(st))]
        if len(uses) != 1 or len(stmts) != 1:
            return f"its forward does not call `self.{attr}` exactly once, before the rotary embedding"
        i = stmts[0]
        st = func.body[i]
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                and st.targets[0].id == var):
            return f"its forward's `self.{attr}` call is not in an assignment to {var}"
        value, outer = st.value, None
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "transpose"
                and [ast.dump(a) for a in value.args] == [ast.dump(ast.Constant(1)), ast.dump(ast.Constant(2))]
                and not value.keywords):
            value, outer = value.func.value, value.func
        if not (isinstance(value, ast.Call) and is_norm(value.func, attr) and len(value.args) == 1
                and not value.keywords):
            return (f"its forward assigns {var} something other than `self.{attr}(...)` or "
                    f"`self.{attr}(...).transpose(1, 2)`")
        between = func.body[i + 1:r]
        if any(isinstance(n, ast.Name) and n.id == var for st2 in between for n in ast.walk(st2)):
            return f"its forward uses {var} between `self.{attr}` and the rotary embedding"
        if outer is None:
            st.value = value.args[0]
        else:
            outer.value = value.args[0]
    func.body[r] = ast.parse(_QK_SOURCE).body[0]
    return None


@functools.lru_cache(maxsize=None)
def _rewrite_qk(cls: type):
    """``cls.forward`` with its QK-norm fused into the rotary embedding (a function), or the reason
    there is none."""
    return _recompiled(cls, _edit_qk_norm_rope, "_normkit_qk_norm_rope", _qk_norm_rope, _QK_FUSED)


def _fuse_qk_norm_rope(model: nn.Module, report: PatchReport) -> None:
    _fuse_forwards(model, report, report.qk_fused, ("q_norm", "k_norm"), ("q_norm", "k_norm"), _QK_FUSED,
                   _rewrite_qk, "QK-norm and RoPE not fused")


# ---------------------------------------------------------------------------------------------
# Sharing a norm's output, in the adapters' dtype, with the PEFT LoRA layers that take it
# (share_adapter_copy=True).
#
# PEFT's default adapters on a bf16 model are fp32: each LoRA layer converts its input
# (``x.to(lora_A.weight.dtype)``), and its ``lora_A`` keeps that copy for its backward, so q, k and v
# each keep their own fp32 copy of one norm output. A patched norm whose decoder layer feeds its output
# to such layers writes that copy once (``functional._apply``'s ``copy``); each LoRA layer's conversion
# takes it when it is handed the very output that carries it, unchanged since (``functional.copy_of``),
# and converts as PEFT does otherwise. Where some adapter keeps its input as it is (no dropout), a
# frozen norm keeps the copy instead of its own output, which the adapters keep anyway. The values are
# those of PEFT's conversion; only the gradient of the norm's output is summed once more, in fp32.

# (the norm's attribute in a decoder layer, the consumers' parent, the consumers' attributes)
_CONSUMERS = (
    ("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj", "qkv_proj")),
    ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj", "gate_up_proj")),
    ("pre_feedforward_layernorm", "mlp", ("gate_proj", "up_proj", "gate_up_proj")),  # Gemma 2, Gemma 3
)


def _take_copy(layer, x, dtype):
    """A LoRA layer's conversion of its input: the norm's copy where the input carries one of this dtype,
    else PEFT's own (always under ``torch.compile``, where Inductor fuses the conversions)."""
    if x is not None and not torch.compiler.is_compiling() and getattr(layer, "cast_input_dtype_enabled", True):
        c = F.copy_of(x, dtype)
        if c is not None:
            return c
    return _compat.peft_cast(layer, x, dtype)


def _adapter_use(layer) -> tuple:
    """``(dtype, keeps)``: the dtype ``layer`` converts its input to now (None: it does not: adapters off
    or merged, casting disabled, an in-place dropout that would write the shared copy), and whether an
    active adapter keeps that converted input as it is (no dropout)."""
    if layer.disable_adapters or layer.merged or not getattr(layer, "cast_input_dtype_enabled", True):
        return None, False
    dtype, keeps = None, False
    lora_a, dropouts = layer.lora_A, layer.lora_dropout
    for name in layer.active_adapters:
        a = lora_a._modules.get(name)
        if a is None:
            continue
        drop = dropouts[name]
        if isinstance(drop, nn.Dropout) and drop.inplace:
            return None, False
        dtype = dtype or a.weight.dtype
        keeps = keeps or isinstance(drop, nn.Identity)
    return dtype, keeps


class _Share:
    """A patched norm's ``output_copy`` (``modules._SaveHint``): the LoRA layers among its decoder
    layer's consumers of its output, looked up at each call (PEFT may wrap them after patching, switch,
    merge or disable adapters); ``(dtype, keep)`` where they convert the output to another dtype."""

    def __init__(self, layer: nn.Module, parent: str, names: tuple):
        self.layer, self.parent, self.names = layer, parent, names

    def takers(self) -> list:
        parent = self.layer._modules.get(self.parent)
        found = (parent._modules.get(n) for n in self.names) if parent is not None else ()
        return [m for m in found if m is not None and _compat.peft_casts_input(m)]

    def uses(self, out_dtype) -> list:
        """``(LoRA layer, dtype, keeps)`` (``_adapter_use``) of each taker that converts an output of
        ``out_dtype`` to another dtype, the first such taker's."""
        found = []
        for m in self.takers():
            d, k = _adapter_use(m)
            if d is not None and d != out_dtype and (not found or d == found[0][1]):
                found.append((m, d, k))
        return found

    def __call__(self, norm: nn.Module, x: torch.Tensor):
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return None
        if (isinstance(norm, HFRMSNorm) and norm.weight is not None
                and torch.promote_types(norm.weight.dtype, x.dtype) != x.dtype):
            return None  # the output is cast after the kernel: no copy can ride on it
        uses = self.uses(x.dtype)
        for m, _, _ in uses:
            _compat.set_peft_cast(m, _take_copy)
        return (uses[0][1], any(k for _, _, k in uses)) if uses else None


def _share_outputs(model: nn.Module, report: PatchReport) -> None:
    """Give each patched norm of a decoder layer a ``_Share`` of its consumers (``report.shares``: those
    with LoRA layers in another dtype now)."""
    for name, layer in model.named_modules():
        for attr, parent, names in _CONSUMERS:
            norm = layer._modules.get(attr)
            if not isinstance(norm, _NORMKIT_CLASSES):
                continue
            if attr == "post_attention_layernorm" and "pre_feedforward_layernorm" in layer._modules:
                continue  # Gemma 2/3: it normalizes the attention's output, which no linear layer takes
            share = norm.output_copy = _Share(layer, parent, names)
            uses = share.uses(None if norm.weight is None else norm.weight.dtype)
            if uses:
                report.shares.append((f"{name}.{attr}" if name else attr, [m for m, _, _ in uses], uses[0][1]))


# ---------------------------------------------------------------------------------------------
# Public functions.


def _decision(module: nn.Module, save: str) -> SaveDecision:
    """What a patched norm's backward keeps when its parameters are frozen, for inputs of its weight's
    dtype (a model's activations usually have it)."""
    if save == "input":
        return SaveDecision(False, "save='input'")
    weight, bias = module.weight, getattr(module, "bias", None)
    like = weight if weight is not None else bias
    dtype = like.dtype if like is not None and like.dtype in _SUPPORTED_DTYPES else torch.float32
    frozen = [t.detach() if t is not None else None for t in (weight, bias)]  # as if frozen
    return save_decision(*frozen, dtype=dtype, offset=getattr(module, "offset", 0.0),
                         casting_mode=getattr(module, "casting_mode", "gemma"))


def _swap(model: nn.Module, replacements: dict[int, nn.Module]) -> None:
    """Replace every occurrence (a module may be shared) of each old module id by its new module."""
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                parent._modules[child_name] = replacements[id(child)]


def patch_model(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    layer_norm: bool = True,
    include: Optional[Callable[[str, nn.Module], bool]] = None,
    fuse_residual_add: bool = False,
    qk_norm_rope: bool = True,
    save: str = "auto",
    share_adapter_copy: bool = True,
) -> PatchReport:
    """Swap the norm modules of ``model`` for normkit's, in place, and report what was done.

    Args:
        model: any ``nn.Module``, e.g. a transformers model, before or after PEFT wrapped it.
        rms_norm: swap the known RMSNorm classes (transformers' Llama/Mistral/Qwen/Phi3/Gemma
            families and ``torch.nn.RMSNorm``).
        layer_norm: swap ``torch.nn.LayerNorm``.
        include: optional ``include(qualified_name, module) -> bool``; a known module it rejects is
            skipped.
        fuse_residual_add: also fuse, in each pre-norm decoder layer, the residual add before
            ``post_attention_layernorm`` into that norm (``fused_add_rms_norm``: one kernel instead
            of an add and a norm, forward and backward). Only layers whose ``forward`` contains
            exactly ``hidden_states = residual + hidden_states; residual = hidden_states;
            hidden_states = self.post_attention_layernorm(hidden_states)`` (transformers' Llama,
            Mistral, Qwen2/3 layers) are rewritten, and only those three statements; other layers are
            listed in the report with the reason.
        qk_norm_rope: also fuse, in each attention whose ``forward`` normalizes q and k per head
            (``self.q_norm``, ``self.k_norm``, swapped for normkit's RMSNorm) and then calls
            ``query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)``
            (transformers' Qwen3 and Gemma 3 attention), each norm and the rotation into one
            ``rms_norm_rope``: the forward's source is rewritten there and nowhere else (the attention
            interface, GQA, masks and caches are the original code). Attention modules that have
            ``q_norm`` and ``k_norm`` but whose forward does not match are listed in the report with
            the reason; ``report.qk_fused`` lists the fused ones. ``False`` keeps HF's rotation after
            normkit's norms.
        save: what the new modules' backward keeps (``torch_frontend.rms_norm``'s ``save``): with
            ``"auto"``, a norm whose parameters are frozen keeps its output rather than its input
            where its weight allows (one activation per norm less in a LoRA model whose adapters
            compute in the activations' dtype); the report lists,
            for each patched norm, which it keeps and why (``PatchReport.saves``).
        share_adapter_copy: where a patched norm of a decoder layer feeds PEFT LoRA layers whose
            adapters compute in another dtype (PEFT's default fp32 adapters on a bf16 model), the norm
            writes its output in that dtype once and every such layer takes that copy instead of
            converting the output itself; a frozen norm whose adapters keep the copy (no dropout) keeps
            it for its own backward too, and nothing of its own. Eager only (under ``torch.compile``
            PEFT's own conversions run, and Inductor fuses them). The same values as PEFT's conversion;
            the report lists the norms that share (``PatchReport.shares``), found when patching (a
            norm patched before ``get_peft_model`` finds its LoRA layers when called).

    Returns:
        A ``PatchReport``; ``print(report)`` lists each swap and each skipped norm-looking module with
        its reason. The new modules keep the old ``Parameter`` objects (dtype, device,
        ``requires_grad``, state-dict keys unchanged) and remember the module they replaced, so
        ``unpatch_model`` can put it back. Patching twice changes nothing: normkit modules are skipped.
    """
    check_save(save)
    report = PatchReport()
    replacements: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if not _looks_like_norm(cls) and not any(cls.__name__ == n for _, n in KNOWN):
            continue
        conv, reason = _converter(cls)
        if conv is None:
            report.skipped.append((name, cls, reason))
            continue
        is_layer_norm = conv is _torch_layer_norm
        if (is_layer_norm and not layer_norm) or (not is_layer_norm and not rms_norm):
            flag = "layer_norm" if is_layer_norm else "rms_norm"
            report.skipped.append((name, cls, f"excluded by {flag}=False"))
            continue
        if include is not None and not include(name, module):
            report.skipped.append((name, cls, "excluded by include()"))
            continue
        if module is model:
            report.skipped.append((name, cls, "the root module cannot be replaced in place; patch its parent"))
            continue
        reason = _has_hooks(module)
        new = conv(module) if reason is None else reason
        if isinstance(new, str):
            report.skipped.append((name, cls, new))
            continue
        new.train(module.training)
        new.save = save
        new.refresh_save_hint()  # from the adopted parameters, for torch.compile
        object.__setattr__(new, _ORIGINAL, module)  # not a submodule: state_dict and .modules() ignore it
        replacements[id(module)] = new
        report.patched.append((name, cls, type(new)))
        report.saves.append((name, _decision(new, save)))
    _swap(model, replacements)
    if share_adapter_copy:
        _share_outputs(model, report)
    if fuse_residual_add:
        _fuse_residual_adds(model, report)
    if qk_norm_rope:
        _fuse_qk_norm_rope(model, report)
    return report


def unpatch_model(model: nn.Module) -> PatchReport:
    """Put back the modules that ``patch_model`` replaced; return what was restored.

    The original module gets the patched module's current ``weight``/``bias`` Parameters (normally
    the very objects it had) and its training mode; PEFT LoRA layers get their own input conversion
    back (``share_adapter_copy``).
    """
    report = PatchReport(verb="restored")
    replacements: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        report.casts += _compat.restore_peft_cast(module)
        if getattr(module.__dict__.get("forward"), _FUSED, False):
            del module.forward
            report.fused.append((name, type(module)))
        if getattr(module.__dict__.get("forward"), _QK_FUSED, False):
            del module.forward
            report.qk_fused.append((name, type(module)))
        orig = module.__dict__.get(_ORIGINAL)
        if orig is None:
            continue
        for pname in ("weight", "bias"):
            p = module._parameters.get(pname)
            if p is not None and getattr(orig, pname, None) is not p:
                setattr(orig, pname, p)
        orig.train(module.training)
        replacements[id(module)] = orig
        report.patched.append((name, type(module), type(orig)))
    _swap(model, replacements)
    return report
