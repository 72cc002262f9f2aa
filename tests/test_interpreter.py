"""normkit/_compat.py (the interpreter): interpreted launches from many threads, patches that leave nothing behind,
numpy >= 2.4's array-to-scalar rule, bf16 rounding, and the Triton version gate.

Every launch here is on CPU tensors, so these run Triton's interpreter on any machine (a GPU one too).
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

import torch_frontend as tf
from normkit import _compat as _interpreter

THREADS, CALLS = 8, 6
M, N = 8, 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (so NaNs compare, and -0.0 differs from 0.0)."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _call(i: int) -> tuple[torch.Tensor, ...]:
    """Call number i: one of four ops (forward, or forward + backward), fp32 or bf16, inputs from seed i."""
    g = torch.Generator().manual_seed(1000 + i)
    dtype = (torch.float32, torch.bfloat16)[(i // 4) % 2]
    x, r, dy = (torch.randn(M, N, generator=g).to(dtype) for _ in range(3))
    w, b = (torch.randn(N, generator=g).to(dtype) for _ in range(2))
    kind = i % 4
    if kind == 0:
        return (tf.rms_norm(x, w, eps=1e-6),)
    if kind == 1:
        return tf.fused_add_rms_norm(x, r, w, eps=1e-6)
    x.requires_grad_(True)
    w.requires_grad_(True)
    if kind == 2:
        y = tf.rms_norm(x, w, eps=1e-6, casting_mode="llama")
        return (y, *torch.autograd.grad(y, (x, w), dy))
    r.requires_grad_(True)
    y, s = tf.fused_add_rms_norm(x, r, w, eps=1e-6)
    return (y, s, *torch.autograd.grad((y, s), (x, r, w), (dy, dy)))


def _is_original(fn, module: str, qualname: str) -> bool:
    return getattr(fn, "__module__", None) == module and getattr(fn, "__qualname__", None) == qualname


def _language_state() -> dict:
    """Every attribute of the modules and classes Triton's interpreter and normkit patch."""
    state = {}
    for obj in (tl, tl.core, tl.math, tl.standard, tl.tensor, tl.dtype, interpreter, interpreter.InterpreterBuilder,
                JITFunction):
        for name, value in list(vars(obj).items()):
            if name not in ("__annotations__", "__dict__", "__weakref__"):
                state[(getattr(obj, "__name__", obj), name)] = value
    return state


def _assert_untouched(before: dict) -> None:
    after = _language_state()
    changed = sorted(str(k) for k in before if after.get(k, before) is not before[k])
    assert not changed, f"left patched after interpreted launches: {changed[:10]}"
    assert _is_original(vars(JITFunction)["__call__"], "triton.runtime.jit", "JITFunction.__call__")
    assert _is_original(vars(interpreter.InterpreterBuilder)["cast_impl"], "triton.runtime.interpreter",
                        "InterpreterBuilder.cast_impl")
    assert _is_original(interpreter._patch_lang_tensor, "triton.runtime.interpreter", "_patch_lang_tensor")


def test_threads_agree_bitwise_with_single_threaded_calls():
    expected = [_call(i) for i in range(THREADS * CALLS)]
    before = _language_state()
    for _ in range(2):  # two rounds: the race on unguarded patches shows within one, nearly always
        results: dict[int, object] = {}
        start = threading.Barrier(THREADS)

        def worker(t: int) -> None:
            start.wait()
            for j in range(CALLS):
                i = t * CALLS + j
                try:
                    results[i] = _call(i)
                except Exception as e:  # noqa: BLE001 -- reported below, with the call's number
                    results[i] = e

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a thread hung"
        errors = {i: repr(r)[:160] for i, r in results.items() if isinstance(r, Exception)}
        wrong = [i for i, outs in results.items() if not isinstance(outs, Exception)
                 and not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, expected[i], strict=True))]
        assert len(results) == len(expected) and not errors and not wrong, (
            f"of {len(expected)} threaded calls, {len(wrong)} differ from the same call single-threaded {wrong}, "
            f"{len(errors)} raised {errors}")
    _assert_untouched(before)


def test_jax_callbacks_and_torch_threads_share_the_lock():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_frontend as jf

    if jax.default_backend() != "cpu":
        pytest.skip("the JAX frontend interprets only on CPU")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((M, N), dtype=np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal(N, dtype=np.float32))
    loss = jax.jit(jax.grad(lambda x, w: jnp.sum(jf.rms_norm(x, w) ** 2), argnums=(0, 1)))
    want_jax = [np.asarray(a) for a in loss(x, w)]
    want_torch = [_call(i) for i in range(4)]
    out: dict = {}
    start = threading.Barrier(4)

    def jax_worker(k):
        start.wait()
        try:
            out[k] = [[np.asarray(a) for a in loss(x, w)] for _ in range(3)]
        except Exception as e:  # noqa: BLE001 -- reported below
            out[k] = e

    def torch_worker(k):
        start.wait()
        try:
            out[k] = [_call(i) for i in range(4)]
        except Exception as e:  # noqa: BLE001
            out[k] = e

    threads = [threading.Thread(target=f, args=(k,)) for k, f in enumerate((jax_worker, jax_worker, torch_worker,
                                                                             torch_worker))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    errors = {k: repr(r)[:300] for k, r in out.items() if isinstance(r, Exception)}
    assert len(out) == 4 and not errors, errors
    for k in (0, 1):
        for got in out[k]:
            for a, b in zip(got, want_jax, strict=True):
                assert np.array_equal(a.view(np.int32), b.view(np.int32))
    for k in (2, 3):
        for got, want in zip(out[k], want_torch, strict=True):
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want, strict=True))


def test_launches_leave_triton_as_they_found_it():
    # Triton 3.6's own device-function calls (tl.sum from a kernel) patch triton.language.core and
    # never undo it; a kernel compiled later in the process would trace those interpreter stubs.
    before = _language_state()
    for i in range(4):
        _call(i + 4)  # bf16: the rounding patch is applied too
    _assert_untouched(before)


def test_no_array_to_scalar_conversion():
    # numpy >= 2.4 raises on int() of a 1-element array (every launch failed with an InterpreterError);
    # numpy 1.25 to 2.3 warn, which is made an error here so that this test fails under either.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for i in range(4):  # every op's forward and backward kernels, and the dW reduction
            _call(i)
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(M, N, generator=g, requires_grad=True), torch.randn(N, generator=g), torch.randn(N, generator=g)
        w.requires_grad_(True)
        b.requires_grad_(True)
        torch.autograd.grad(tf.layer_norm(x, w, b).sum(), (x, w, b))


def test_bf16_rounding_is_round_to_nearest_even():
    rng = np.random.default_rng(0)
    u = np.concatenate([
        rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32),
        # exact ties (low half 0x8000) with even and odd kept halves, and their neighbours
        np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0xFF7FFFFF], dtype=np.uint32),
    ])
    f = u.view(np.float32)
    f = f[~np.isnan(f)]
    got = _interpreter._f32_to_bf16_rtne(f)
    want = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)
    assert _interpreter._f32_to_bf16_rtne(np.array([np.nan], np.float32))[0] == 0x7FC0


def test_testing_rounds_to_bf16_as_torch_does():
    """normkit.testing.rounded (the test inputs' and references' rounding) against torch's conversion,
    on random bit patterns, exact ties, the largest finite values, infinities, subnormals and NaN."""
    from normkit.testing import rounded

    rng = np.random.default_rng(1)
    u = np.concatenate([
        rng.integers(0, 2**32, 8192, dtype=np.uint64).astype(np.uint32),
        np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0xFF7FFFFF, 0x7F800000,
                  0xFF800000, 0x00000001, 0x80008000, 0x00000000, 0x80000000], dtype=np.uint32),
    ])
    f = u.view(np.float32)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the random bit patterns
        got = rounded(f, "bfloat16")
    want = torch.from_numpy(f.copy()).to(torch.bfloat16).to(torch.float64).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(f))
    ok = ~np.isnan(f)
    assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_patches_fit_this_triton():
    if not triton.__version__.startswith(_interpreter.TESTED_TRITON):
        pytest.skip(f"Triton {triton.__version__} is not among the tested versions (_interpreter.TESTED_TRITON)")
    assert [p.name for p in _interpreter.PATCHES if _interpreter._fits(p)] == [p.name for p in _interpreter.PATCHES]


def test_untested_triton_version_warns_once(monkeypatch):
    expected = _call(6)  # bf16 fwd + bwd
    monkeypatch.setattr(_interpreter, "_CHOSEN", {})
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    with pytest.warns(_interpreter.NormkitInterpreterWarning, match=r"normkit: .*Triton 3\.99\.0.*untested") as rec:
        got = _call(6)
    assert len(rec) == 1 and "skipped: none" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _interpreter.NormkitInterpreterWarning)
        again = _call(6)  # once per process and version
    for outs in (got, again):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, expected, strict=True))


def test_a_patch_whose_target_changed_is_skipped_with_a_warning(monkeypatch):
    expected = _call(0)[0]
    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type, rounding=None):  # a different shape than the one bf16-rtne was written for
        return original(self, src, dst_type)

    monkeypatch.setattr(_interpreter, "_CHOSEN", {})
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
    with pytest.warns(_interpreter.NormkitInterpreterWarning, match="skipped: bf16-rtne"):
        y = _call(0)[0]  # fp32: runs as before
    assert interpreter.InterpreterBuilder.cast_impl is cast_impl
    assert torch.equal(_bits(y), _bits(expected))
