"""JAX-side implementations and how each mode is timed, the way a network uses them.

- ``xla``: ``jax.jit`` of a jnp reference (the same math as the Torch expression); frozen parameters
  go through ``lax.stop_gradient``;
- ``normkit_jax``: jax_frontend's functions with ``implementation=None`` (auto: ``"triton"`` on a GPU
  with jax-triton), frozen parameters through ``lax.stop_gradient`` as ``jax_frontend.freeze``
  applies it;
- ``normkit_jax_pallas`` / ``normkit_jax_xla``: the same functions with ``implementation="pallas"``
  (the Pallas kernels; on a GPU through Pallas's Triton lowering) and ``implementation="xla"``
  (plain jax.numpy under normkit's custom_vjp, with its frozen semantics: no dW/dB is traced for a
  frozen weight/bias). Same jit, same vjp split, same timer as ``normkit_jax``; unlike ``xla``
  (a jnp expression differentiated by JAX's autodiff), they share normkit's custom_vjp;
- ``tokamax``: ``tokamax.layer_norm(..., implementation="triton")`` (``subtract_mean=False`` for
  RMSNorm), when tokamax imports.

Backward modes time the vjp function returned by a *separate* jitted forward,
``jax.jit(lambda fn, ct: fn(ct))(vjp_fn, ct)``: with forward and backward in one jit XLA fuses them
into one pass, which a network cannot do because other layers sit in between. The fused add's
backward returns its one d(x + residual) once, not as both dx and d_residual (``_one_residual_grad``). ``fwd_bwd`` issues
the two calls back to back. All timing issues many asynchronous calls and synchronizes once.
Peak memory is XLA's own account of the compiled program (``memory_analysis()``: temporaries +
outputs), since JAX cannot reset a device's peak counter.
"""
from __future__ import annotations

import time

from benchmarks.bytemodel import DTYPES
from normkit.ops import OPS

EPS = {name: op.default_eps for name, op in OPS.items()}


class JaxInputs:
    def __init__(self, op: str, M: int, N: int, dtype: str, n_sets: int, seed: int = 0):
        import jax
        import jax.numpy as jnp

        dt = jnp.dtype(DTYPES[dtype])
        fused = op == "fused_add_rms_norm"
        per_set = 4 if fused else 2  # x, dy (+ residual, ds)

        def make(key):  # one compiled call makes every array of the case
            keys = jax.random.split(key, per_set * n_sets + 2)
            acts = [jax.random.normal(keys[i], (M, N), jnp.float32).astype(dt) for i in range(per_set * n_sets)]
            w = (1.0 + 0.1 * jax.random.normal(keys[-2], (N,), jnp.float32)).astype(dt)
            b = (0.1 * jax.random.normal(keys[-1], (N,), jnp.float32)).astype(dt)
            return acts, w, b

        acts, w, b = jax.jit(make)(jax.random.PRNGKey(seed))
        self.op, self.n_sets = op, n_sets
        self.x, self.dy = acts[0:n_sets], acts[n_sets:2 * n_sets]
        self.residual = acts[2 * n_sets:3 * n_sets] if fused else None
        self.ds = acts[3 * n_sets:4 * n_sets] if fused else None
        self.weight = w
        self.bias = b if op == "layer_norm" else None

    def primals(self, i: int) -> tuple:
        i %= self.n_sets
        by_name = {"x": self.x[i], "weight": self.weight, "bias": self.bias,
                   "residual": self.residual[i] if self.residual is not None else None}
        return tuple(by_name[name] for name in OPS[self.op].inputs)

    def cotangents(self, i: int) -> tuple:
        i %= self.n_sets
        return (self.dy[i],) + ((self.ds[i],) if self.ds is not None else ())

    def free(self) -> None:
        self.x = self.residual = self.dy = self.ds = self.weight = self.bias = None


def xla_fn(op: str):
    import jax.numpy as jnp
    from jax import lax

    eps = EPS[op]

    def rms(x, w):
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return w * xf.astype(x.dtype)

    if op == "rms_norm":
        return lambda x, w: (rms(x, w),)
    if op == "layer_norm":
        def layer_norm(x, w, b):
            xf = x.astype(jnp.float32)
            xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
            y = xc * lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
            return ((y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype),)
        return layer_norm

    def fused(x, r, w):
        s = x + r
        return rms(s, w), s

    return fused


# bench.py's impl name -> jax_frontend's ``implementation=`` (None: auto).
NORMKIT_JAX_IMPLS = {"normkit_jax": None, "normkit_jax_pallas": "pallas", "normkit_jax_xla": "xla"}


def normkit_jax_fn(op: str, implementation: str | None = None):
    import jax_frontend as jf

    eps = EPS[op]
    kw = {"implementation": implementation}
    if op == "rms_norm":
        return lambda x, w: (jf.rms_norm(x, w, eps, **kw),)
    if op == "layer_norm":
        return lambda x, w, b: (jf.layer_norm(x, w, b, eps, **kw),)
    return lambda x, r, w: tuple(jf.fused_add_rms_norm(x, r, w, eps, **kw))


def normkit_jax_pallas_fn(op: str):
    return normkit_jax_fn(op, "pallas")


def normkit_jax_xla_fn(op: str):
    return normkit_jax_fn(op, "xla")


NORMKIT_JAX_FNS = {"normkit_jax": normkit_jax_fn, "normkit_jax_pallas": normkit_jax_pallas_fn,
                   "normkit_jax_xla": normkit_jax_xla_fn}


def tokamax_fn(op: str):
    import tokamax

    eps = EPS[op]
    if op == "rms_norm":
        return lambda x, w: (tokamax.layer_norm(x, w, None, epsilon=eps, subtract_mean=False,
                                                implementation="triton"),)
    if op == "layer_norm":
        return lambda x, w, b: (tokamax.layer_norm(x, w, b, epsilon=eps, implementation="triton"),)
    raise NotImplementedError("tokamax has no fused residual-add + RMSNorm")


def _frozen(op: str, f, mode: str):
    """f with the weight and bias under stop_gradient in bwd_frozen; f itself otherwise."""
    if mode != "bwd_frozen":
        return f
    from jax import lax

    spec = OPS[op]

    def g(*args):
        return f(*(lax.stop_gradient(a) if n in spec.params else a for n, a in zip(spec.inputs, args)))
    return g


def _mem(compiled) -> int | None:
    try:
        ma = compiled.memory_analysis()
        return int(ma.temp_size_in_bytes + ma.output_size_in_bytes)
    except Exception:  # noqa: BLE001 (an optional statistic)
        return None


def _one_residual_grad(op: str, grads: tuple) -> tuple:
    """The backward's outputs as a training step consumes them. The fused add's gradients of x and
    of the residual are one array (d(x + residual)); returned twice from a jit, XLA must copy it into
    a second output buffer (a full [M, N] memcpy, 62 µs at bf16 8192x8192 on the H200), which no
    step that feeds both to later ops pays, and Torch's autograd returns one tensor for both. So the
    residual's entry is left out, for every implementation alike (the byte model counts dx once)."""
    if op != "fused_add_rms_norm":
        return grads
    return (grads[0],) + tuple(grads[2:])


class Jitted:
    """The jitted functions of one implementation for one input set, shared by the modes, so that
    ``fwd_bwd`` reuses what ``bwd_full`` compiled."""

    def __init__(self, op: str, f):
        import jax

        self.fwd = jax.jit(f)
        self.fwd_train = {frozen: jax.jit(lambda *p, g=_frozen(op, f, "bwd_frozen" if frozen else "bwd_full"):
                                          jax.vjp(g, *p))
                          for frozen in (False, True)}
        self.bwd = jax.jit(lambda fn, ct: _one_residual_grad(op, fn(ct)))


def mode_call(jitted: Jitted, inp: JaxInputs, mode: str):
    """``(call, vjp0)``: ``call(i)`` issues the i-th call of ``mode`` on input set ``i % n_sets``,
    asynchronously (nothing synchronized); ``vjp0`` is the first set's saved vjp function for the
    backward modes, None otherwise. The one mode -> call mapping, used by ``time_e2e`` and
    ``benchmarks/device_time.py``.

    ``fwd``: ``jitted.fwd(*primals)``. ``bwd_full`` / ``bwd_frozen``: ``jitted.bwd(vjp_fn, cotangents)``
    with the vjp functions of the separately jitted ``jitted.fwd_train[frozen]``, made here, once per
    input set. ``fwd_bwd``: the training forward then the backward, back to back."""
    k = inp.n_sets
    if mode == "fwd":
        jf = jitted.fwd
        return (lambda i: jf(*inp.primals(i))), None
    fwd_train, bwd = jitted.fwd_train[mode == "bwd_frozen"], jitted.bwd
    if mode == "fwd_bwd":
        def call(i):
            _, vjp_fn = fwd_train(*inp.primals(i))
            return bwd(vjp_fn, inp.cotangents(i))
        return call, None
    saved = [fwd_train(*inp.primals(i))[1] for i in range(k)]

    def call(i):
        i %= k
        return bwd(saved[i], inp.cotangents(i))
    return call, saved[0]


def time_e2e(jitted: Jitted, inp: JaxInputs, mode: str, timer) -> dict:
    import jax

    sync = jax.block_until_ready
    t0 = time.perf_counter()
    call, vjp0 = mode_call(jitted, inp, mode)
    sync(call(0))
    if mode == "fwd":
        compile_s = time.perf_counter() - t0
        us = timer.loop(call, sync)
        mem = _mem(jitted.fwd.lower(*inp.primals(0)).compile())
        return {"median_us": us, "peak_mem_bytes": mem, "compile_s": round(compile_s, 3),
                "mem_method": "xla memory_analysis: temp + output"}

    fwd_train, bwd = jitted.fwd_train[mode == "bwd_frozen"], jitted.bwd
    if mode == "fwd_bwd":
        _, vjp0 = fwd_train(*inp.primals(0))
        mem_f = _mem(fwd_train.lower(*inp.primals(0)).compile())
    else:
        mem_f = 0
    compile_s = time.perf_counter() - t0
    us = timer.loop(call, sync)
    mem_b = _mem(bwd.lower(vjp0, inp.cotangents(0)).compile())
    mem = None if mem_b is None or mem_f is None else mem_b + mem_f
    method = "xla memory_analysis: " + ("forward temp + output, " if mode == "fwd_bwd" else "") + "backward temp + output"
    return {"median_us": us, "peak_mem_bytes": mem, "compile_s": round(compile_s, 3), "mem_method": method}
