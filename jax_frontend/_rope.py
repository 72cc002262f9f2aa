"""``rms_norm_rope`` for JAX: RMSNorm over each head's D columns, then rotary position embedding, as one
``jax.custom_vjp`` over three implementations:

- ``"triton"``: ``normkit.kernels.rope`` through the JAX backends of ``jax_frontend._launch``
  (jax-triton on GPU, Triton's interpreter behind a host callback on CPU), the same plans as the
  Torch frontend's (``normkit.launch.plan_rope_forward`` / ``plan_rope_backward``);
- ``"pallas"``: ``normkit.kernels.rope_pallas`` through ``pallas_call`` (``jax_frontend._pallas``'s
  ``rope_forward`` / ``rope_backward``; interpret mode on CPU): neither torch nor Triton needed;
- ``"xla"``: plain ``jax.numpy`` over ``normkit.norm_math``'s array-API math (the same rounding points).

As for ``rms_norm`` (``jax_frontend.functional``): which gradients the backward computes comes from
``.perturbed`` (``symbolic_zeros=True``): a weight under ``jax.lax.stop_gradient`` (``freeze``) or not
differentiated is frozen, and ``save`` (``normkit.saving.decide``) then keeps the output instead of
x. cos and sin are constants: their cotangents are zero (symbolic).

JAX arrays are row-major in their logical shape: the Triton kernels address x, the output and the
gradients through contiguous strides, and cos/sin with stride 0 over the dimensions they broadcast
over (never expanded); the Pallas kernels read x as [M, D] rows and the tables as their stored
[T, D] rows, each x row's table row computed from the same row layout (``_pallas_rows``). A
[B, H, S, D] x is whatever XLA materialized for it. Not supported here: ``vmap`` of the Triton
implementation, sharded inputs, forward-mode differentiation.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_frontend import _launch, functional
from jax_frontend._compat import SymbolicZero
from jax_frontend.functional import _as_array, _host
from normkit import checks, norm_math, record, rope, saving
from normkit.launch import plan_rope_backward, plan_rope_forward
from normkit.ops import GRADS, Options

__all__ = ["rms_norm_rope"]

IMPLEMENTATIONS = ("triton", "pallas", "xla")  # auto: the first that runs (functional._unavailable)


@dataclasses.dataclass(frozen=True)
class _Config:
    opts: Options
    interleaved: bool
    save: str
    implementation: str  # one of IMPLEMENTATIONS


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needs:
    """What the backward differentiates, and what the residuals hold (static aux data)."""

    x: bool
    weight: bool
    from_output: bool = False  # the residuals hold the output and the weight's recovery, not x


# ---------------------------------------------------------------------------------------------
# The Triton implementation.


def _platform() -> str:
    platform = jax.default_backend()
    return platform if platform in ("cpu", "rocm") else "cuda"


def _layout(x, cos, sin):
    """``(layout, strides of x, cos, sin)``: JAX arrays are contiguous in their logical shape."""
    xs = rope.contiguous_strides(x.shape)[:-1]
    cs = rope.broadcast_strides(cos.shape, rope.contiguous_strides(cos.shape), x.shape)[:-1]
    ss = rope.broadcast_strides(sin.shape, rope.contiguous_strides(sin.shape), x.shape)[:-1]
    layout = rope.row_layout(tuple(x.shape[:-1]), xs, cs, ss)
    if layout is None:
        raise ValueError(f"normkit: x of shape {tuple(x.shape)} has leading dimensions that do not merge into three "
                         f"row indices with cos's {tuple(cos.shape)}")
    return layout, tuple(layout.strides(s) for s in (xs, cs, ss))


def _dtype(a):
    return None if a is None else _launch.dtype_name(a.dtype)


def _empty_forward(x, *, store_stats: bool, store_rec: bool) -> dict:
    """The forward's buffers for an x without rows: nothing to launch."""
    out = {"Y": jnp.zeros(x.shape, x.dtype)}
    if store_stats:
        out["RSTD"] = jnp.zeros((0,), jnp.float32)
    if store_rec:
        out["REC"] = jnp.zeros((x.shape[-1] + 1,), jnp.float32)
    return out


def _empty_backward(saved, weight, grads) -> dict:
    """The backward's gradients for an x without rows: nothing to launch."""
    out = {"DX": jnp.zeros(saved.shape, saved.dtype)} if grads.dx else {}
    if grads.dw:
        out["DW"] = jnp.zeros((saved.shape[-1],), weight.dtype)
    return out


def _triton_forward(cfg: _Config, x, weight, cos, sin, *, store_stats: bool, store_rec: bool) -> dict:
    D = x.shape[-1]
    M = x.size // D
    if M == 0:
        return _empty_forward(x, store_stats=store_stats, store_rec=store_rec)
    layout, (xs, cs, ss) = _layout(x, cos, sin)
    call = plan_rope_forward(D, layout.rows, _dtype(x), _dtype(weight), cfg.opts, cfg.interleaved, store_stats,
                             store_rec, (xs, cs, ss, xs), 1, tuple(x.shape),
                             table_dtypes=(_dtype(cos), _dtype(sin)))
    return _launch.backend(_platform()).launch(call, {"X": x, "W": weight, "COS": cos, "SIN": sin})


def _triton_backward(cfg: _Config, saved, weight, cos, sin, dout, rstd, rec, *, needs: _Needs) -> dict:
    D = saved.shape[-1]
    grads = GRADS[(needs.x, needs.weight and weight is not None, False)]
    if saved.size == 0:
        return _empty_backward(saved, weight, grads)
    layout, (xs, cs, ss) = _layout(saved, cos, sin)
    call, reduce = plan_rope_backward(D, layout.rows, _dtype(saved), _dtype(weight), cfg.opts, cfg.interleaved,
                                      grads, needs.from_output, (xs, cs, ss, xs, xs), 1,
                                      _launch.num_sms(_platform()), tuple(saved.shape),
                                      table_dtypes=(_dtype(cos), _dtype(sin)))
    backend = _launch.backend(_platform())
    out = backend.launch(call, {"X": saved, "W": weight, "COS": cos, "SIN": sin, "DY": dout, "RSTD": rstd,
                                "REC": rec})
    if reduce is not None:
        out.update(backend.launch(reduce, {"DW_PART": out.pop("DW_PART")}))
    return out


# ---------------------------------------------------------------------------------------------
# The Pallas implementation.


def _pallas():
    """``jax_frontend._pallas``, imported on first use (as ``functional`` imports it): Pallas is not
    imported with ``jax_frontend``."""
    from jax_frontend import _pallas

    return _pallas


def _pallas_rows(x, cos, sin):
    """x's row layout as the Pallas kernels read it (``_pallas.RopeRows``): x as [M, D] rows (contiguous,
    so its flat row is ``(i0 n1 + i1) n2 + i2``) and the tables' row strides over the three row
    indices, in rows."""
    layout, (xs, cs, ss) = _layout(x, cos, sin)
    _, n1, n2 = layout.rows
    D = x.shape[-1]
    assert all(s in (0, D * n) for s, n in zip(xs, (n1 * n2, n2, 1))), (xs, layout)  # x's rows are its flat rows
    assert cs == ss, (cs, ss)  # one shape (rope.check), both contiguous
    return _pallas().RopeRows(n1, n2, tuple(s // D for s in cs))


def _pallas_forward(cfg: _Config, x, weight, cos, sin, *, store_stats: bool, store_rec: bool) -> dict:
    D = x.shape[-1]
    M = x.size // D
    if M == 0:
        return _empty_forward(x, store_stats=store_stats, store_rec=store_rec)
    out = _pallas().rope_forward(x.reshape(M, D), weight, cos.reshape(-1, D), sin.reshape(-1, D),
                                 _pallas_rows(x, cos, sin), opts=cfg.opts, interleaved=cfg.interleaved,
                                 store_stats=store_stats, store_rec=store_rec)
    out["Y"] = out["Y"].reshape(x.shape)
    return out


def _pallas_backward(cfg: _Config, saved, weight, cos, sin, dout, rstd, rec, *, needs: _Needs) -> dict:
    D = saved.shape[-1]
    M = saved.size // D
    grads = GRADS[(needs.x, needs.weight and weight is not None, False)]
    if M == 0:
        return _empty_backward(saved, weight, grads)
    out = _pallas().rope_backward(saved.reshape(M, D), weight, cos.reshape(-1, D), sin.reshape(-1, D),
                                  dout.reshape(M, D), rstd, rec, _pallas_rows(saved, cos, sin), opts=cfg.opts,
                                  interleaved=cfg.interleaved, grads=grads, from_output=needs.from_output)
    if "DX" in out:
        out["DX"] = out["DX"].reshape(saved.shape)
    return out


# ---------------------------------------------------------------------------------------------
# The XLA implementation.


def _record(name: str, **flags) -> None:
    if record.active():
        cpu = jax.default_backend() == "cpu"
        record.emit(record.Launch(kernel=name, frontend="jax-cpu" if cpu else "jax-gpu", grid=(), num_warps=0,
                                  flags=flags, partial_buffers=(), interpreted=False, implementation="xla"))


def _xla_forward(cfg: _Config, x, weight, cos, sin, *, store_stats: bool, store_rec: bool) -> dict:
    o = cfg.opts
    _record("xla_rms_norm_rope_fwd", HAS_W=weight is not None, CASTING=int(o.casting), INTERLEAVED=cfg.interleaved,
            STORE_STATS=store_stats, STORE_REC=store_rec)
    y, rstd = norm_math.rms_norm_rope_forward(x, weight, cos, sin, eps=o.eps, offset=o.offset, casting=o.casting,
                                              interleaved=cfg.interleaved, xp=jnp)
    out = {"Y": y}
    if store_stats:
        out["RSTD"] = rstd
    if store_rec:
        out["REC"] = norm_math.rope_recovery_array(weight, N=x.shape[-1], x_dtype=x.dtype, offset=o.offset,
                                                   casting=o.casting, interleaved=cfg.interleaved, xp=jnp)
    return out


def _xla_backward(cfg: _Config, saved, weight, cos, sin, dout, rstd, rec, *, needs: _Needs) -> dict:
    o = cfg.opts
    compute_dw = needs.weight and weight is not None
    _record("xla_rms_norm_rope_bwd", HAS_W=weight is not None, CASTING=int(o.casting), INTERLEAVED=cfg.interleaved,
            COMPUTE_DX=needs.x, COMPUTE_DW=compute_dw, FROM_Y=needs.from_output)
    out = {}
    dx, dw = norm_math.rms_norm_rope_backward(
        saved, weight, cos, sin, dout, rstd, rec, from_output=needs.from_output, offset=o.offset, casting=o.casting,
        interleaved=cfg.interleaved, compute_dx=needs.x, compute_dw=compute_dw, xp=jnp)
    if needs.x:
        out["DX"] = dx.astype(saved.dtype)
    if compute_dw:
        out["DW"] = dw.astype(weight.dtype)
    return out


_PASSES = {  # implementation -> (forward, backward)
    "triton": (_triton_forward, _triton_backward),
    "pallas": (_pallas_forward, _pallas_backward),
    "xla": (_xla_forward, _xla_backward),
}


def _forward(cfg: _Config, *args, **kw) -> dict:
    return _PASSES[cfg.implementation][0](cfg, *args, **kw)


def _backward(cfg: _Config, *args, **kw) -> dict:
    return _PASSES[cfg.implementation][1](cfg, *args, **kw)


# ---------------------------------------------------------------------------------------------
# The custom_vjp.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(cfg: _Config, x, weight, cos, sin):
    return _forward(cfg, x, weight, cos, sin, store_stats=False, store_rec=False)["Y"]


def _value(p):
    return None if p is None else p.value


def _perturbed(p) -> bool:
    return p is not None and p.perturbed


def _saves_output(cfg: _Config, needs: _Needs, x, weight, cos, sin) -> bool:
    """``normkit.saving.decide`` for this call (as ``functional._saves_output`` for ``rms_norm``), with
    ``norm_math.rope_unsafe_reason`` where the weight's values are known; traced, ``saving.traced_rule``,
    and the forward's recovery is poisoned (NaN dx) where the weight turns out unsafe. Where the tables'
    values are known, tables with a pair of columns that is not a usable rotation
    (``norm_math.rope_table_unsafe_reason``) keep x (``"output"`` raises); traced, the backward gives
    those rows a NaN dx."""
    x_dtype = _launch.dtype_name(x.dtype)
    traced = isinstance(weight, jax.core.Tracer)
    from_output = saving.decide(
        rope.RMS_NORM_ROPE, cfg.save, trained=["weight"] if needs.weight else [], needs_dx=needs.x,
        row_length=x.shape[-1], has_params=weight is not None, has_bias=False, offset=cfg.opts.offset,
        x_dtype=x_dtype, unsafe=None if traced else lambda: norm_math.rope_unsafe_reason(
            _host(weight), x_dtype=x_dtype, offset=cfg.opts.offset, casting=cfg.opts.casting,
            interleaved=cfg.interleaved))
    if not from_output or isinstance(cos, jax.core.Tracer) or isinstance(sin, jax.core.Tracer):
        return from_output
    reason = norm_math.rope_table_unsafe_reason(_host(cos), _host(sin), x_dtype=x_dtype, casting=cfg.opts.casting,
                                                interleaved=cfg.interleaved)
    if reason is None:
        return True
    if cfg.save == "output":
        raise ValueError(f"normkit: save='output' cannot recover x_hat from the output with these tables: {reason}; "
                         "pass save='auto' or 'input'")
    return False


def _rope_fwd(cfg: _Config, x, weight, cos, sin):
    xv, wv, cv, sv = _value(x), _value(weight), _value(cos), _value(sin)
    needs = _Needs(x=_perturbed(x), weight=_perturbed(weight))
    if not (needs.x or needs.weight):
        out = _forward(cfg, xv, wv, cv, sv, store_stats=False, store_rec=False)["Y"]
        return out, (None, None, None, None, None, None, needs)
    from_output = _saves_output(cfg, needs, xv, wv, cv, sv)
    res = _forward(cfg, xv, wv, cv, sv, store_stats=True, store_rec=from_output)
    needs = dataclasses.replace(needs, from_output=from_output)
    saved = res["Y"] if from_output else xv
    return res["Y"], (saved, wv, cv, sv, res["RSTD"], res.get("REC"), needs)


def _rope_bwd(cfg: _Config, res, ct):
    saved, w, c, s, rstd, rec, needs = res
    if not (needs.x or needs.weight) or ct is None or isinstance(ct, SymbolicZero):
        return None, None, None, None
    out = _backward(cfg, saved, w, c, s, ct, rstd, rec, needs=needs)
    return out.get("DX"), out.get("DW"), None, None  # cos and sin: constants


_rope.defvjp(_rope_fwd, _rope_bwd, symbolic_zeros=True)


def _implementation(implementation) -> str:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"normkit: rms_norm_rope has the implementations {IMPLEMENTATIONS} (or None: auto); got "
                         f"{implementation!r}")
    platform = jax.default_backend()
    if implementation is None:
        return next(n for n in IMPLEMENTATIONS if functional._unavailable(n, platform) is None)
    reason = functional._unavailable(implementation, platform)
    if reason is not None:
        raise RuntimeError(f"normkit: implementation={implementation!r} cannot run on the {platform} backend: {reason}")
    return implementation


def rms_norm_rope(x: jax.Array, weight: jax.Array | None, cos: jax.Array, sin: jax.Array, eps: float = 1e-6, *,
                  offset: float = 0.0, casting_mode: str = "llama", interleaved: bool = False, save: str = "auto",
                  implementation: str | None = None) -> jax.Array:
    """RMSNorm over the last axis D, then rotary position embedding, in one pass:
    ``out = R(rms_norm(x, weight))`` with ``R(y) = y * cos + rotate_half(y) * sin`` (HF's
    ``apply_rotary_pos_emb``; ``interleaved``: GPT-J's pairs ``(2i, 2i + 1)``). The math, rounding
    points and ``save`` are those of ``torch_frontend.rms_norm_rope`` (``normkit.norm_math``):
    y is rounded to x's dtype as ``rms_norm`` returns it; the rotation is HF's in x's dtype under
    ``casting_mode="none"``, fp32 with one rounding otherwise.

    Args:
        x: ``(..., D)`` float32, bfloat16 or float16, D even (e.g. [B, S, H, D] or [B, H, S, D]).
        weight: ``(D,)`` or None; frozen when under ``jax.lax.stop_gradient`` (``freeze``) or not
            differentiated: then ``save="auto"`` keeps the output rather than x where it is safe (the
            weight, and the tables where their values are known: ``norm_math.rope_table_usable``;
            traced tables with a pair that is not a usable rotation give those rows a NaN dx).
        cos, sin: x's dtype or float32, one shape broadcasting against x as in HF (e.g. [B, 1, S, D]);
            constants (zero cotangent).
        eps, offset, casting_mode, save: as in ``rms_norm``; static.
        interleaved: GPT-J pairing; static.
        implementation: ``None`` (auto: ``"triton"`` where it runs, else ``"pallas"``, else ``"xla"``, as
            ``jax_frontend.resolve_implementation`` picks for ``rms_norm``), ``"triton"``, ``"pallas"``
            (``normkit.kernels.rope_pallas``: needs neither torch nor Triton) or ``"xla"``.

    Returns:
        ``(..., D)`` in x's dtype.
    """
    x, weight, cos, sin = (_as_array(a, n) for a, n in ((x, "x"), (weight, "weight"), (cos, "cos"), (sin, "sin")))
    spec = lambda a: None if a is None else (tuple(a.shape), _launch.dtype_name(a.dtype))  # noqa: E731
    rope.check(x_shape=tuple(x.shape), x_dtype=_launch.dtype_name(x.dtype), weight=spec(weight), cos=spec(cos),
               sin=spec(sin), interleaved=interleaved)
    checks.check_save(save)
    opts = rope.RMS_NORM_ROPE.options(eps=eps, offset=offset, casting_mode=casting_mode)
    return _rope(_Config(opts, interleaved, save, _implementation(implementation)), x, weight, cos, sin)
