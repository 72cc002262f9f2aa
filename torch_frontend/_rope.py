"""``rms_norm_rope``: RMSNorm over each head's D columns, then rotary position embedding, in one kernel
(``normkit.kernels.rope``), with its own ``torch.autograd.Function``.

Layouts. Every tensor is read in place through its strides (``normkit.rope.row_layout``): x as
[B, S, H, D] rows or as the [B, H, S, D] transposed view of such a buffer, cos/sin broadcast with
stride 0 (never expanded). The output (and x's gradient) is allocated like x (``torch.empty_like``:
x's own strides where x is dense, else a dense layout in x's dimension order), so a [B, H, S, D]
view of a [B, S, H, D] buffer gives a [B, H, S, D] view of a fresh [B, S, H, D] buffer: exactly the
layout HF's eager rotary embedding returns for it, which attention (``scaled_dot_product_attention``
on [B, H, S, D], or flash-attention's [B, S, H, D] after the transpose back) takes without a copy.
Only a last dimension that is not contiguous is copied (with a ``NormkitCopyWarning``); an output
gradient that does not fit x's row grouping is copied into x's layout.

What the backward keeps (``save``) is decided by ``normkit.saving.decide``, as for ``rms_norm``
(``_Signature.saves_output``, once per weight version: ``_bound.Decisions``): with the weight frozen and
safe, the output, its per-row rstd and the weight's recovery 1 / w (no x); otherwise x and rstd. A
call signature seen before (``_Signature``, kept in ``_bound.BOUND``) launches without validation or
planning.

Under ``torch.compile`` (``_compiled``) the call is no graph break: the kernels run as the opaque
custom ops ``normkit::rms_norm_rope_fwd`` / ``normkit::rms_norm_rope_bwd`` (fake implementations for the
trace, dynamic shapes included), which Inductor calls from its generated code, with a frozen or a
trained weight. ``_Kernels`` keeps what the eager Function keeps. The weight's
values are unseen while tracing, so ``save="auto"`` follows ``saving.traced_rule``: the output where the
weight is frozen, the offset 0 and x not float16 (Qwen3's q/k norms, not Gemma's ``1 + w``); a weight
that turns out unsafe (RMSNorm's rule or the pair ratio) gives a NaN dx, never a quietly imprecise one.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from normkit import checks, driver, norm_math, rope, saving
from normkit.launch import INTERPRETER_NUM_SMS, plan_rope_backward, plan_rope_forward
from normkit.ops import GRADS, Options
from torch_frontend import _bound, _compat
from torch_frontend._backend import BACKEND, DTYPE_NAMES, NormkitCopyWarning, dtype_name, num_sms, resolve_neg
from torch_frontend._backend import keys as _backend_keys

__all__ = ["rms_norm_rope"]


@dataclasses.dataclass(frozen=True)
class _Config:
    opts: Options
    interleaved: bool
    save: str


def _name(t) -> str:
    return DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)


def _check(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save) -> Options:
    """The options of a valid call; raises, naming the argument, before anything is launched."""
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        if t is None and name == "weight":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"normkit: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested:
            raise TypeError(f"normkit: {name} must be a dense (torch.strided) tensor; got layout {t.layout}")
        if t.device != x.device:
            raise ValueError(f"normkit: {name} is on {t.device} but x is on {x.device}; all tensors must share a device")
    rope.check(x_shape=tuple(x.shape), x_dtype=_name(x),
               weight=None if weight is None else (tuple(weight.shape), _name(weight)),
               cos=(tuple(cos.shape), _name(cos)), sin=(tuple(sin.shape), _name(sin)), interleaved=interleaved)
    checks.check_save(save)
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"normkit: x is on {x.device}; normkit runs on CUDA (compiled) or CPU (interpreted)")
    return rope.RMS_NORM_ROPE.options(eps=eps, offset=offset, casting_mode=casting_mode)


def _columns_contiguous(t, name: str, warn: bool):
    """``t`` with its last dimension contiguous (copied, and said so, where it is not)."""
    t = resolve_neg(t, name)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        if warn:
            warnings.warn(f"normkit: {name} of shape {tuple(t.shape)} has strides {t.stride()}; its last dimension "
                          "is not contiguous, so it is copied", NormkitCopyWarning, stacklevel=4)
        t = t.contiguous()
    return t


def _empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if driver.POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


def _empty_like(t) -> torch.Tensor:
    out = torch.empty_like(t)  # preserve_format: t's strides where t is dense
    if driver.POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def _launch(call, inputs: dict, outputs: dict) -> None:
    """One plan on these tensors, into the outputs given: the Torch backend's bound launch (compiled on
    CUDA, Triton's interpreter on CPU)."""
    BACKEND.launch(call, inputs, outs=outputs)


def _restored(t, name: str, dtype, device, shape: tuple | None = None, contiguous: bool = False):
    """``t``, a tensor the forward saved as unpacked for the backward, in ``dtype`` on ``device``, with no
    lazy negation, and dense where ``contiguous``; ``shape``: the one it must have. (The rows' and
    tables' last dimension is made contiguous by ``_Signature.backward``.)"""
    if t is None:
        return None
    if shape is not None and t.shape != shape:
        raise RuntimeError(f"normkit: {name} came back from its saved-tensor hook with shape {tuple(t.shape)}; "
                           f"the forward saved it with shape {shape}")
    t = resolve_neg(t, name)
    if t.dtype != dtype or t.device != device:
        t = t.to(device, dtype)
    return t.contiguous() if contiguous else t


def _table_strides(t, x) -> tuple:
    return rope.broadcast_strides(tuple(t.shape), t.stride(), tuple(x.shape))[:-1]


class _Signature:
    """A validated eager call signature (options, and each tensor's class, shape, strides, dtype and
    device): the row layout, the forward's plans, the backward's plans per output-gradient layout,
    and the save choices made per weight version (``_bound.Decisions``). Kept in ``_bound.BOUND``,
    the Torch frontend's one cache, so that a repeated call (a training loop's) is neither validated
    nor planned again."""

    __slots__ = ("cfg", "layout", "M", "D", "dtypes", "torch_dtypes", "device", "index", "sizes", "w_stride",
                 "x_shape", "x_rows", "fwd_strides", "fwd", "bwd", "decisions", "trip")

    def __init__(self, cfg: _Config, x, weight, cos, sin):
        self.cfg = cfg
        self.D = D = x.shape[-1]
        self.M = x.numel() // D if D else 0
        self.x_shape = tuple(x.shape)
        self.x_rows = x.stride()[:-1]  # x's row strides: their order is the rows' order (rstd's)
        out_strides = torch.empty_like(x).stride()[:-1]  # the output's: allocated like x
        tables = (_table_strides(cos, x), _table_strides(sin, x))
        self.layout = rope.row_layout(self.x_shape[:-1], x.stride()[:-1], *tables, out_strides)
        if self.layout is None:
            raise ValueError(f"normkit: x of shape {self.x_shape} and strides {x.stride()} has leading dimensions "
                             "that do not merge into three row indices with cos's and sin's; pass x.contiguous()")
        self.fwd_strides = tuple(self.layout.strides(t) for t in (x.stride()[:-1], *tables, out_strides))
        self.dtypes = (_name(x), None if weight is None else _name(weight), _name(cos), _name(sin))
        self.torch_dtypes = (x.dtype, None if weight is None else weight.dtype, cos.dtype, sin.dtype)
        self.device, self.index = x.device, x.get_device()
        self.sizes = (x.shape, None if weight is None else weight.shape, torch.Size((self.M,)), torch.Size((D + 1,)))
        self.w_stride = 1 if weight is None else weight.stride(0)
        self.fwd: dict = {}  # (store_stats, store_rec) -> its bound launch (``Backend.bind``)
        # ((the saved rows', cos's and sin's strides), dy strides, grads, from_output, weight stride, cos's and
        # sin's shapes) -> (dy strides, the bound launch, reduction plan)
        self.bwd: dict = {}
        self.decisions = _bound.Decisions()
        self.trip = None  # ``_bound.trip`` of the signature's device, once an output-keeping forward needs it

    def forget(self) -> None:
        self.decisions.forget()

    def saves_output(self, x, weight) -> bool:
        """``normkit.saving.decide`` for this call: RMSNorm's safety rule plus the rotation's pair ratio
        (``norm_math.rope_unsafe_reason``), the weight's values read (a host synchronization) once per
        weight version, as for ``rms_norm`` (a write torch does not version is caught by the forward's
        flag, ``_bound.trip``). A trained weight keeps x (and save="output" raises); inside a
        non-reentrant checkpoint, ``"auto"`` keeps x. Once a forward has found tables that are not
        rotations (``_bound.rope_tables_tripped``, which warns), ``"auto"`` keeps x in this process."""
        cfg = self.cfg
        if cfg.save == "input":
            return False
        if _bound.rope_tables_tripped() and cfg.save == "auto":
            return False
        hooked = _compat.checkpointing()
        if hooked and cfg.save == "auto":
            return False
        if weight is None:
            return self._decide(x, weight, hooked)
        return self.decisions.saves_output(weight, None, self._decide, x, weight, hooked)

    def _decide(self, x, weight, hooked: bool) -> bool:
        """``saves_output``'s ``normkit.saving.decide``, the weight's values read."""
        cfg, o = self.cfg, self.cfg.opts

        def unsafe():
            with torch.no_grad():
                return norm_math.rope_unsafe_reason(weight.detach(), x_dtype=x.dtype, offset=o.offset,
                                                    casting=o.casting, interleaved=cfg.interleaved)

        return saving.decide(rope.RMS_NORM_ROPE, cfg.save, trained=["weight"] if weight is not None and
                             weight.requires_grad else [], needs_dx=True, row_length=self.D,
                             has_params=weight is not None, has_bias=False, offset=o.offset,
                             x_dtype=self.dtypes[0], unsafe=unsafe, hooked=hooked)

    def forward(self, x, weight, cos, sin, store_stats: bool, store_rec: bool) -> tuple:
        """``(out, rstd, rec)``; rstd and rec None where not stored. Where rec is stored, the kernel also
        sets ``_bound.trip``'s slots: the weight's if it breaks the safety rule, the tables' if a pair of
        table columns is not a usable rotation (the backward then gives those rows a NaN dx)."""
        out = _empty_like(x)
        rstd = _empty((self.M,), torch.float32, x.device) if store_stats else None
        rec = _empty((self.D + 1,), torch.float32, x.device) if store_rec else None
        if self.M == 0:
            if store_rec:  # no rows: no backward will read it
                rec.zero_()
            return out, rstd, rec
        launch = self.fwd.get((store_stats, store_rec))
        if launch is None:
            x_dtype, w_dtype, c_dtype, s_dtype = self.dtypes
            call = plan_rope_forward(self.D, self.layout.rows, x_dtype, w_dtype, self.cfg.opts, self.cfg.interleaved,
                                     store_stats, store_rec, self.fwd_strides, self.w_stride, self.x_shape,
                                     table_dtypes=(c_dtype, s_dtype), has_trip=True)
            launch = self.fwd[(store_stats, store_rec)] = BACKEND.bind(call, x)
        trip = None
        if store_rec:
            trip = self.trip
            if trip is None:
                trip = self.trip = _bound.trip(x.device)
        launch(x, weight, cos, sin, trip, outs=[out, rstd, rec])  # ROPE_FWD_INPUTS, ROPE_FWD_OUTPUTS
        return out, rstd, rec

    def backward_plan(self, saved, weight, cos, sin, dout, dx, grads, from_output: bool, strides: tuple) -> tuple:
        """``(dy_strides, launch, reduce)`` for the layouts of the arrays it reads (the saved rows', the
        output gradient's, the weight's and the tables', which a saved-tensor hook may have changed): the
        backward plan's bound launch and the dW reduction's plan (None without dW); ``dy_strides`` None
        where dy must first be copied into x's layout (x of more than four dimensions only). ``strides``:
        the saved rows', cos's and sin's."""
        w_stride = self.w_stride if weight is None else weight.stride(0)
        k = (strides, dout.stride(), grads, from_output, w_stride, cos.shape, sin.shape)
        entry = self.bwd.get(k)
        if entry is None:
            rows = (saved.stride()[:-1], _table_strides(cos, saved), _table_strides(sin, saved), dout.stride()[:-1],
                    dx.stride()[:-1] if dx is not None else None)
            layout = self.layout
            if any(r is not None and layout.strides(r) is None for r in rows):
                # an array that does not merge into the forward's row grouping (attention's [B, H, S, D]
                # gradient of an output laid out [B, S, H, D], or an array a saved-tensor hook laid out
                # anew): a grouping of its own that every array of the backward merges into. Groups merge
                # adjacent dimensions in x's memory order (x's strides first), so a row's flat index, and
                # rstd's order, is the same under any of them.
                layout = rope.row_layout(self.x_shape[:-1], self.x_rows, *(r for r in rows if r is not None))
                if layout is None:
                    return None, None, None
            strides = tuple((0, 0, 0) if r is None else layout.strides(r) for r in rows)
            dy_strides = strides[3]
            sms = num_sms(saved.device) if saved.device.type == "cuda" else INTERPRETER_NUM_SMS
            x_dtype, w_dtype, c_dtype, s_dtype = self.dtypes
            call, reduce = plan_rope_backward(self.D, layout.rows, x_dtype, w_dtype, self.cfg.opts,
                                              self.cfg.interleaved, grads, from_output, strides, w_stride, sms,
                                              self.x_shape, table_dtypes=(c_dtype, s_dtype))
            entry = self.bwd[k] = (dy_strides, BACKEND.bind(call, saved), reduce)
        return entry


    def as_saved(self, saved, weight, cos, sin, rstd, rec, kept: tuple) -> tuple:
        """What the forward kept, as it kept it. A saved-tensor hook (``torch.autograd.graph.
        saved_tensors_hooks``, or one registered after the forward on one of the node's saved tensors)
        may hand back another dtype, device or shape, a lazily negated view, or other strides; so may a
        write to ``.data`` of a tensor saved as it was given. Each array gets the forward's dtype and
        device back, negations applied, the statistics contiguous; a shape other than the forward's
        raises. The rows', weight's and tables' strides the backward's plan reads as they are (its key).
        ``kept``: the statistics the forward saved (rstd, the weight's recovery), as the forward's own
        objects, which only a hook can replace."""
        x_dtype, w_dtype, c_dtype, s_dtype = self.torch_dtypes
        index, sizes = self.index, self.sizes
        if saved.dtype is not x_dtype or saved.get_device() != index or saved.is_neg() or saved.shape != sizes[0]:
            saved = _restored(saved, "the saved rows", x_dtype, self.device, sizes[0])
        if weight is not None and (weight.dtype is not w_dtype or weight.get_device() != index or weight.is_neg()
                                   or weight.shape != sizes[1]):
            weight = _restored(weight, "the saved weight", w_dtype, self.device, sizes[1])
        if cos.dtype is not c_dtype or cos.get_device() != index or cos.is_neg():
            cos = _restored(cos, "the saved cos", c_dtype, self.device)
        if sin.dtype is not s_dtype or sin.get_device() != index or sin.is_neg():
            sin = _restored(sin, "the saved sin", s_dtype, self.device)
        if rstd is not kept[0]:
            rstd = _restored(rstd, "the saved rstd", torch.float32, self.device, sizes[2], contiguous=True)
        if rec is not kept[1]:
            rec = _restored(rec, "the saved recovery", torch.float32, self.device, sizes[3], contiguous=True)
        return saved, weight, cos, sin, rstd, rec

    def backward(self, saved, weight, cos, sin, dout, rstd, rec, grads, from_output: bool) -> tuple:
        """``(dx, dw)`` (None where not asked for) from what the forward kept: ``saved`` (x, or the
        output ``from_output``), rstd and the weight's recovery ``rec``."""
        if dout.dtype != saved.dtype or (self.D > 1 and dout.stride(-1) != 1) or dout.is_neg():
            dout = _columns_contiguous(dout, "the output gradient", warn=False).to(saved.dtype)
        strides = (saved.stride(), cos.stride(), sin.stride())
        if self.D > 1 and (strides[0][-1] != 1 or strides[1][-1] != 1 or strides[2][-1] != 1):  # a hook's
            saved, cos, sin = (_columns_contiguous(t, name, warn=False) for t, name in
                               ((saved, "the saved rows"), (cos, "the saved cos"), (sin, "the saved sin")))
            strides = (saved.stride(), cos.stride(), sin.stride())
        dx = _empty_like(saved) if grads.dx else None
        dw = None
        if self.M == 0:
            if grads.dw:
                dw = torch.zeros((self.D,), dtype=weight.dtype, device=weight.device)
            return dx, dw
        dy_strides, launch, reduce = self.backward_plan(saved, weight, cos, sin, dout, dx, grads, from_output, strides)
        if launch is None:  # no three row indices cover dy as well (x of more than four dimensions): x's layout
            dout = torch.empty_like(saved).copy_(dout)
            dy_strides, launch, reduce = self.backward_plan(saved, weight, cos, sin, dout, dx, grads, from_output,
                                                            strides)
            if launch is None:  # the saved rows or tables as a saved-tensor hook laid them out anew
                raise RuntimeError(f"normkit: the saved rows {tuple(saved.shape)} (strides {saved.stride()}) and "
                                   f"tables cos {cos.stride()}, sin {sin.stride()} that saved-tensor hooks handed "
                                   "back share no three row indices; hand back the layouts the forward saved")
        part = _empty(launch.call.out_specs["DW_PART"][0], torch.float32, saved.device) if grads.dw else None
        launch(saved, weight, cos, sin, dout, rstd, rec, outs=[dx, part])  # ROPE_BWD_INPUTS, ROPE_BWD_OUTPUTS
        if reduce is not None:
            dw = _empty((self.D,), weight.dtype, weight.device)
            _launch(reduce, {"DW_PART": part}, {"DW": dw})
        return dx, dw


class RMSNormRoPEFunction(torch.autograd.Function):
    """``forward(sig, x, weight, cos, sin)``; cos and sin are constants (no gradient)."""

    @staticmethod
    def forward(ctx, sig: _Signature, x, weight, cos, sin):
        from_output = sig.saves_output(x, weight)
        out, rstd, rec = sig.forward(x, weight, cos, sin, True, from_output)
        ctx.sig, ctx.from_output = sig, from_output
        ctx.kept = (weakref.ref(rstd), None if rec is None else weakref.ref(rec))  # not kept alive by it
        ctx.save_for_backward(out if from_output else x, weight, cos, sin, rstd, rec)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph=True: a second backward through it raises
            return _backward_once(ctx, dout)
        return _backward(ctx, dout)


def _backward(ctx, dout) -> tuple:
    sig = ctx.sig
    rstd_ref, rec_ref = ctx.kept
    saved, weight, cos, sin, rstd, rec = sig.as_saved(*ctx.saved_tensors, (rstd_ref(), rec_ref and rec_ref()))
    needs = ctx.needs_input_grad  # (sig, x, weight, cos, sin)
    grads = GRADS[(bool(needs[1]), bool(needs[2] and weight is not None), False)]
    if not grads.any:
        return None, None, None, None, None
    dx, dw = sig.backward(saved, weight, cos, sin, dout, rstd, rec, grads, ctx.from_output)
    return None, dx, dw, None, None


# under create_graph=True: the gradients computed without a graph, marked so that differentiating
# them again raises (torch's ``once_differentiable``)
_backward_once = once_differentiable(_backward)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "llama", interleaved: bool = False,
                  save: str = "auto") -> torch.Tensor:
    """RMSNorm over each row's last dimension D, then rotary position embedding, in one pass:
    ``out = R(rms_norm(x, weight, eps, offset=offset, casting_mode=casting_mode))`` with
    ``R(y) = y * cos + rotate_half(y) * sin`` (HF's ``apply_rotary_pos_emb`` after its unsqueeze;
    ``rotate_half(t) = cat(-t[..., D/2:], t[..., :D/2])``, or, ``interleaved``, GPT-J's pairs
    ``(2i, 2i + 1)``). Qwen3's q_norm/k_norm then RoPE; Gemma 3's is ``offset=1.0,
    casting_mode="gemma"``.

    Rounding: the normalized y is rounded to x's dtype exactly as ``rms_norm`` returns it (so
    ``rms_norm_rope(x, ...) == rope(rms_norm(x, ...))`` up to the rotation's own rounding). With
    ``casting_mode="none"`` the rotation is HF's, evaluated in x's dtype operation by operation
    (cos and sin rounded to x's dtype, each product and the sum rounded); with ``"llama"`` and
    ``"gemma"`` it is computed in fp32 from the rounded y and rounded once. Against HF's bf16 eager
    code (which rounds both products and the sum) that is at most a couple of bf16 roundings apart.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16, D even: [B, S, H, D] rows, or a strided view such
            as the [B, H, S, D] transpose of a [B, S, H, D] buffer (read in place).
        weight: ``(D,)`` of any float dtype, or None.
        cos, sin: the rotary tables, x's dtype or float32, of one shape broadcasting against x as in HF
            (e.g. [B, 1, S, D] or [1, 1, S, D] for x [B, H, S, D]; [B, S, 1, D] for x [B, S, H, D]);
            read in place with stride 0 over broadcast dimensions. They are constants: they receive
            no gradient (None), whether or not they require one.
        eps, offset, casting_mode: as in ``rms_norm``.
        interleaved: GPT-J pairing of the columns instead of ``rotate_half``'s.
        save: what the backward keeps: ``"auto"`` keeps the output (not x) where the weight is frozen
            and x_hat can be recovered from it (``normkit.saving.decide``: the safety rule of
            ``rms_norm``, and no rotation pair whose weights differ by more than
            ``norm_math.ROPE_PAIR_RATIO``, since the recovery of column j carries its partner's
            rounding error times that ratio); the backward then recovers ``y = R^-1(out)`` (the rotation by -theta; per
            pair through its 2 x 2 determinant, 1 for HF's tables, attention_scaling^2 for tables
            that carry one) and ``x_hat = y / (weight + offset)``. Rows whose tables have a pair that is
            not a usable rotation (``norm_math.ROPE_TABLE_RATIO``) get a NaN dx from that backward; the
            next call warns (``NormkitRopeTablesWarning``) and ``"auto"`` keeps x from then on in the
            process (``_bound.ROPE_TABLES_KEEP_X``). ``"input"`` keeps x; ``"output"``
            keeps the output and raises where the weight is trained or unsafe.

    Returns:
        ``out`` of x's shape and dtype, laid out like x (``torch.empty_like(x)``): a [B, H, S, D] view
        of a [B, S, H, D] buffer for the transposed x, as HF's own rotary embedding returns.

    Under ``torch.compile`` the call is not a graph break: the kernels run as custom ops that
    Inductor calls, frozen or trained weight alike; ``save`` keeps its meaning there, decided without
    the weight's values (``_traced_saves_output``).

    Not supported: double backward.
    """
    if torch.compiler.is_compiling():
        return _compiled(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
    return _eager(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)


def _key(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save) -> tuple:
    """The signature of a call (each option with its class). Raises AttributeError for a non-tensor,
    RuntimeError for a tensor without strides, TypeError (on hashing) for an unhashable option: the
    caller then validates, which names it."""
    return ("rms_norm_rope", eps.__class__, eps, offset.__class__, offset, casting_mode.__class__, casting_mode,
            interleaved.__class__, interleaved, save.__class__, save) + _backend_keys(x, weight, cos, sin)


def _signature(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save) -> tuple:
    """``(sig, x, weight, cos, sin)``: the call's ``_Signature`` (validated and planned on first sight,
    then found in ``_bound.BOUND``), and the tensors it reads (copied where one cannot be read in place)."""
    try:
        k = _key(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
        sig = _bound.BOUND.get(k)
        if sig is not None and (x.is_neg() or cos.is_neg() or sin.is_neg() or (weight is not None and weight.is_neg())):
            sig = None
    except (AttributeError, TypeError, RuntimeError):  # the checks below name it
        k = sig = None
    if sig is None:
        opts = _check(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
        given = (x, cos, sin, weight)
        x = _columns_contiguous(x, "x", warn=True)
        cos = _columns_contiguous(cos, "cos", warn=True)
        sin = _columns_contiguous(sin, "sin", warn=True)
        weight = resolve_neg(weight, "weight")
        sig = _Signature(_Config(opts, interleaved, save), x, weight, cos, sin)
        if k is not None and all(a is b for a, b in zip(given, (x, cos, sin, weight))):  # nothing copied
            _bound.remember(k, sig)
    return sig, x, weight, cos, sin


def _eager(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save) -> torch.Tensor:
    """The kernels (``normkit.kernels.rope``): the call outside ``torch.compile`` (``rms_norm_rope``
    sends a traced call to ``_compiled``). A call signature seen before (``_bound.BOUND``) is launched
    without validation or planning. The Function is entered through torch's ``Function.apply``: its C
    apply (``_compat.direct_apply``, which the norms' eager calls take) saved this op no measurable
    host time (docs/PERFORMANCE_RECORD.md)."""
    sig, x, weight, cos, sin = _signature(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
    if not (torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))):
        return sig.forward(x, weight, cos, sin, False, False)[0]
    return RMSNormRoPEFunction.apply(sig, x, weight, cos, sin)


# ---------------------------------------------------------------------------------------------
# Under torch.compile: the kernels as custom ops, called from the compiled graph.


def _traced_saves_output(cfg: _Config, x, weight) -> bool:
    """``normkit.saving.decide`` where the weight's values are unseen (a trace of fake tensors):
    ``saving.traced_rule`` (no offset, x not float16) for ``"auto"``; the forward's recovery is then
    poisoned (NaN dx) where the weight turns out unsafe, the pair ratio included
    (``norm_math.rope_recovery_array``), as the kernels' is, and the backward's rows where a pair of
    table columns is not a usable rotation. ``"auto"`` keeps x once the process has met such tables
    (``_bound.ROPE_TABLES_KEEP_X``: read while tracing, so dynamo guards on it and a graph traced before
    it was set is traced again)."""
    o = cfg.opts
    if cfg.save == "auto" and _bound.ROPE_TABLES_KEEP_X:
        return False
    return saving.decide(rope.RMS_NORM_ROPE, cfg.save, trained=["weight"] if weight is not None and
                         weight.requires_grad else [], needs_dx=x.requires_grad, row_length=x.shape[-1],
                         has_params=weight is not None, has_bias=False, offset=o.offset, x_dtype=_name(x), unsafe=None)


def _compiled(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save) -> torch.Tensor:
    """Inside a ``torch.compile`` trace: the kernels through the opaque custom ops
    ``normkit::rms_norm_rope_fwd`` / ``normkit::rms_norm_rope_bwd`` (``_Kernels``' backward), which
    Inductor calls from its generated code. It keeps what the eager Function keeps, decided without
    the weight's values (``_traced_saves_output``)."""
    opts = _check(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
    trained = weight is not None and weight.requires_grad
    args = (float(eps), float(offset), casting_mode, interleaved, save)
    if not (torch.is_grad_enabled() and (x.requires_grad or trained)):
        return torch.ops.normkit.rms_norm_rope_fwd(x, weight, cos, sin, *args, False, False)[0]
    from_output = _traced_saves_output(_Config(opts, interleaved, save), x, weight)
    return _Kernels.apply(args, from_output, trained, x, weight, cos, sin)


def _op_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, eps: float,
            offset: float, casting_mode: str, interleaved: bool, save: str, store_stats: bool,
            store_rec: bool) -> list[torch.Tensor]:
    """``[out, rstd, rec]`` of real tensors (an absent one: an empty ``(0,)`` tensor): the eager forward.
    Keeping the output, it reads the tables' flag after the launch (``_bound.rope_tables_tripped``: the
    compiled graph decided while tracing, so the switch it sets takes effect at its next trace)."""
    sig, x, weight, cos, sin = _signature(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
    out, rstd, rec = sig.forward(x, weight, cos, sin, store_stats, store_rec)
    if store_rec:
        _bound.rope_tables_tripped()
    return [out] + [x.new_empty((0,), dtype=torch.float32) if t is None else t for t in (rstd, rec)]


def _op_bwd(saved: torch.Tensor, weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
            dout: torch.Tensor, rstd: torch.Tensor, rec: Optional[torch.Tensor], eps: float, offset: float,
            casting_mode: str, interleaved: bool, save: str, from_output: bool, dx: bool,
            dw: bool) -> list[torch.Tensor]:
    """``[dx, dw]`` of real tensors (one not asked for: an empty ``(0,)`` tensor): the eager backward,
    with the signature of the saved tensor (x, or the output, laid out as x is)."""
    sig, saved, weight, cos, sin = _signature(saved, weight, cos, sin, eps, offset, casting_mode, interleaved, save)
    grads = GRADS[(dx, dw and weight is not None, False)]
    outs = sig.backward(saved, weight, cos, sin, dout, rstd, rec if from_output else None, grads, from_output)
    return [saved.new_empty((0,)) if t is None else t for t in outs]


_rope_fwd_op = torch.library.custom_op("normkit::rms_norm_rope_fwd", _op_fwd, mutates_args=())
_rope_bwd_op = torch.library.custom_op("normkit::rms_norm_rope_bwd", _op_bwd, mutates_args=())


@_rope_fwd_op.register_fake
def _(x, weight, cos, sin, eps, offset, casting_mode, interleaved, save, store_stats, store_rec):
    M, D = x.numel() // x.shape[-1], x.shape[-1]
    return [torch.empty_like(x), x.new_empty((M,) if store_stats else (0,), dtype=torch.float32),
            x.new_empty((D + 1,) if store_rec else (0,), dtype=torch.float32)]


@_rope_bwd_op.register_fake
def _(saved, weight, cos, sin, dout, rstd, rec, eps, offset, casting_mode, interleaved, save, from_output, dx, dw):
    return [torch.empty_like(saved) if dx else saved.new_empty((0,)),
            weight.new_empty((saved.shape[-1],)) if dw and weight is not None else saved.new_empty((0,))]


class _Kernels(torch.autograd.Function):
    """``forward(args, from_output, trained, x, weight, cos, sin)`` through the custom ops (``args``: eps,
    offset, casting_mode, interleaved, save). It keeps what the eager Function keeps: the output, rstd
    and the weight's recovery (``from_output``), or x and rstd. ``trained``: dW is computed."""

    @staticmethod
    def forward(ctx, args: tuple, from_output: bool, trained: bool, x, weight, cos, sin):
        out, rstd, rec = torch.ops.normkit.rms_norm_rope_fwd(x, weight, cos, sin, *args, True, from_output)
        ctx.args, ctx.from_output, ctx.trained = args, from_output, trained
        ctx.save_for_backward(out if from_output else x, weight, cos, sin, rstd, rec if from_output else None)
        # A view, not the tensor itself: traced by dynamo, an autograd.Function output that is also
        # saved receives a zero gradient (as in ``_composite._FromOutput``).
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        saved, weight, cos, sin, rstd, rec = ctx.saved_tensors
        dx, dw = torch.ops.normkit.rms_norm_rope_bwd(saved, weight, cos, sin, dout, rstd, rec, *ctx.args,
                                                     ctx.from_output, True, ctx.trained)
        # dx whether or not x needs it (autograd drops what is not needed): under dynamo,
        # needs_input_grad need not count the non-tensor arguments
        return None, None, None, dx, dw if ctx.trained else None, None, None
