"""JAX-side implementations and how each mode is timed (benchmarks/README.md, "How each peer is run").

``xla``: ``jax.jit`` of a jnp expression under JAX's own autodiff; ``normkit_jax`` / ``normkit_jax_pallas``
/ ``normkit_jax_xla``: jax_frontend with ``implementation=`` None / "pallas" / "xla". Frozen parameters go
through ``lax.stop_gradient``. Backward modes time the vjp function of a separately jitted forward, as a
network runs it; peak memory is XLA's ``memory_analysis()`` of the compiled program.
"""
from __future__ import annotations

import time

from benchmarks.bytemodel import DTYPES
from normkit.ops import OPS

EPS = {name: op.default_eps for name, op in OPS.items()}
# bench.py's impl name -> jax_frontend's ``implementation=`` (None: auto).
NORMKIT_JAX_IMPLS = {"normkit_jax": None, "normkit_jax_pallas": "pallas", "normkit_jax_xla": "xla"}


class JaxInputs:
    """Rotated activation sets (x, dy, and the fused add's residual and ds) and one set of parameters."""

    def __init__(self, op: str, M: int, N: int, dtype: str, n_sets: int, seed: int = 0):
        import jax
        import jax.numpy as jnp

        dt = jnp.dtype(DTYPES[dtype])
        fused = op == "fused_add_rms_norm"
        per_set = 4 if fused else 2

        def make(key):  # one compiled call makes every array of the case
            keys = jax.random.split(key, per_set * n_sets + 2)
            acts = [jax.random.normal(keys[i], (M, N), jnp.float32).astype(dt) for i in range(per_set * n_sets)]
            w = (1.0 + 0.1 * jax.random.normal(keys[-2], (N,), jnp.float32)).astype(dt)
            return acts, w, (0.1 * jax.random.normal(keys[-1], (N,), jnp.float32)).astype(dt)

        acts, w, b = jax.jit(make)(jax.random.PRNGKey(seed))
        self.op, self.n_sets = op, n_sets
        sets = [acts[i * n_sets:(i + 1) * n_sets] for i in range(per_set)]
        self.x, self.dy = sets[0], sets[1]
        self.residual, self.ds = (sets[2], sets[3]) if fused else (None, None)
        self.weight, self.bias = w, (b if op == "layer_norm" else None)

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
        return w * (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)

    def layer_norm(x, w, b):
        xc = x.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), axis=-1, keepdims=True)
        y = xc * lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
        return ((y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype),)

    def fused(x, r, w):
        s = x + r
        return rms(s, w), s

    return {"rms_norm": lambda x, w: (rms(x, w),), "layer_norm": layer_norm, "fused_add_rms_norm": fused}[op]


def normkit_jax_fn(op: str, implementation: str | None = None):
    import jax_frontend as jf

    f, eps = getattr(jf, op), EPS[op]
    return lambda *primals: tuple(f(*primals, eps, implementation=implementation)) if op == "fused_add_rms_norm" \
        else (f(*primals, eps, implementation=implementation),)


def _frozen(op: str, f):
    """f with the weight and bias under stop_gradient."""
    from jax import lax

    spec = OPS[op]
    return lambda *args: f(*(lax.stop_gradient(a) if n in spec.params else a for n, a in zip(spec.inputs, args)))


def _mem(compiled) -> int | None:
    try:
        ma = compiled.memory_analysis()
        return int(ma.temp_size_in_bytes + ma.output_size_in_bytes)
    except Exception:  # noqa: BLE001 (an optional statistic)
        return None


def _one_residual_grad(op: str, grads: tuple) -> tuple:
    """The backward's outputs as a training step consumes them. The fused add's gradients of x and
    of the residual are one array (d(x + residual)); returned twice from a jit, XLA must copy it into
    a second output buffer (a full [M, N] memcpy), which no step that feeds both to later ops pays,
    and Torch's autograd returns one tensor for both. So the residual's entry is left out, for every
    implementation alike (the byte model counts dx once)."""
    return (grads[0],) + tuple(grads[2:]) if op == "fused_add_rms_norm" else grads


class Jitted:
    """The jitted functions of one implementation, shared by the modes (``fwd_bwd`` reuses what
    ``bwd_full`` compiled)."""

    def __init__(self, op: str, f):
        import jax

        self.fwd = jax.jit(f)
        self.fwd_train = {False: jax.jit(lambda *p: jax.vjp(f, *p)),
                          True: jax.jit(lambda *p, g=_frozen(op, f): jax.vjp(g, *p))}
        self.bwd = jax.jit(lambda fn, ct: _one_residual_grad(op, fn(ct)))


def time_e2e(jitted: Jitted, inp: JaxInputs, mode: str, timer) -> dict:
    """Time ``mode``: ``fwd`` is ``jitted.fwd(*primals)``; ``bwd_full`` / ``bwd_frozen`` call ``jitted.bwd``
    on the vjp functions of the separately jitted training forward, made once per input set; ``fwd_bwd``
    issues the training forward then the backward, back to back."""
    import jax

    sync = jax.block_until_ready
    t0 = time.perf_counter()
    fwd_train, bwd, k = jitted.fwd_train[mode == "bwd_frozen"], jitted.bwd, inp.n_sets
    if mode == "fwd":
        def call(i):
            return jitted.fwd(*inp.primals(i))
    elif mode == "fwd_bwd":
        def call(i):
            return bwd(fwd_train(*inp.primals(i))[1], inp.cotangents(i))
    else:
        saved = [fwd_train(*inp.primals(i))[1] for i in range(k)]

        def call(i):
            return bwd(saved[i % k], inp.cotangents(i))
    sync(call(0))
    compile_s = time.perf_counter() - t0
    us = timer.loop(call, sync)
    if mode == "fwd":
        mem, method = _mem(jitted.fwd.lower(*inp.primals(0)).compile()), "temp + output"
    else:
        vjp0 = fwd_train(*inp.primals(0))[1]
        mem_f = _mem(fwd_train.lower(*inp.primals(0)).compile()) if mode == "fwd_bwd" else 0
        mem_b = _mem(bwd.lower(vjp0, inp.cotangents(0)).compile())
        mem = None if mem_b is None or mem_f is None else mem_b + mem_f
        method = ("forward temp + output, " if mode == "fwd_bwd" else "") + "backward temp + output"
    return {"median_us": us, "peak_mem_bytes": mem, "compile_s": round(compile_s, 3),
            "mem_method": f"xla memory_analysis: {method}"}
