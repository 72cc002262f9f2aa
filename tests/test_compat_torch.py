"""torch_frontend/_compat.py and normkit/_compat.py's launch entries: each private torch or Triton entry
point normkit uses, checked on the installed versions, so that an upgrade that moves one fails here,
loudly, rather than somewhere else (the interpreter's patches: tests/test_interpreter.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_frontend import _compat  # noqa: E402


def test_private_entry_points_are_found():
    """Every entry has torch's own answer on this torch (a fallback would be slower or looser)."""
    assert _compat._TRANSFORMS_ACTIVE is not None
    assert _compat._IS_LEGACY_BATCHED is not None
    assert _compat._TOP_HOOKS is not None
    assert _compat._C_APPLY is not None and _compat.unwrap_exited is not None
    assert _compat.LAYOUT_CHECKS
    if torch.cuda.is_available():  # a CPU-only torch has no CUDA entries (the public fallbacks are never reached)
        assert _compat._GET_DEVICE is not None and _compat._RAW_STREAM is not None


def test_direct_apply_is_the_functions_own_apply():
    """The C apply of a Function without ``setup_context`` gives what ``Function.apply`` gives: the
    output, its grad_fn of the Function's backward class, and that backward's gradient; and
    ``unwrap_exited`` hands a live tensor back as it is."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, k, x):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return None, g * ctx.k

    x = torch.randn(3, requires_grad=True)
    assert _compat.unwrap_exited(x) is x
    direct = _compat.direct_apply(Double)
    y, ref = direct(2.0, x), Double.apply(2.0, x)
    assert type(y.grad_fn) is type(ref.grad_fn) is Double._backward_cls
    assert torch.equal(y, ref)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full((3,), 2.0))


def test_transforms_active():
    assert not _compat.transforms_active()
    seen = []

    def f(x):
        seen.append(_compat.transforms_active())
        return x.sin()

    torch.func.vmap(f)(torch.ones(3, 2))
    torch.func.grad(lambda x: f(x).sum())(torch.ones(3))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        seen.append(_compat.transforms_active())
    assert seen == [True, True, True]


@pytest.mark.parametrize("answer", ["is_legacy_batched", "_storage_unreachable"])
def test_is_legacy_batched(answer):
    """torch's answer, and the fallback without it: a gradient batched by ``is_grads_batched`` (no
    storage) counts as batched, a plain tensor does not."""
    is_batched = getattr(_compat, answer)
    seen = []
    for batched in (True, False):
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: seen.append(is_batched(g)))
        torch.autograd.grad(y, x, torch.eye(3) if batched else torch.ones(3), is_grads_batched=batched)
    assert seen == [True, False] and not is_batched(torch.randn(2))


def _batched_gradient(like):
    """A gradient batched by ``is_grads_batched``, of ``like``'s shape and dtype, as a backward sees it."""
    seen = []
    x = torch.randn(like.shape, dtype=like.dtype, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(g) or g)
    torch.autograd.grad(y, x, torch.randn(2, *like.shape, dtype=like.dtype), is_grads_batched=True)
    assert _compat.is_legacy_batched(seen[0]) and seen[0].shape == like.shape and seen[0].dtype == like.dtype
    return seen[0]


def test_layout_check_tells_layouts_apart():
    """``layout_check``: the tensors it was made from, and others of their layouts, pass; another
    stride, shape, dtype, grad flag, a lazy negation, a batched gradient, a subclass that dispatches, a
    missing tensor or a tensor on another device do not."""
    a, w = torch.randn(4, 6), torch.randn(6, dtype=torch.bfloat16)
    check = _compat.layout_check((a, w))
    assert check(a, w) and check(torch.randn(4, 6), torch.zeros(6, dtype=torch.bfloat16))
    assert check(torch.randn(4, 7)[:, :6].contiguous(), w)  # its own storage offset does not matter
    others = {
        "strides": (torch.randn(6, 4).t(), w), "sliced rows": (torch.randn(4, 7)[:, :6], w), "shape": (a[:3], w),
        "dtype": (a.double(), w), "grad flag": (a.clone().requires_grad_(), w), "negated": (torch._neg_view(a), w),
        "batched": (a, _batched_gradient(w)), "None": (a, None), "subclass": (a, _subclass(w)),
    }
    if torch.cuda.is_available():
        others["device"] = (a.cuda(), w)
    for what, args in others.items():
        assert not check(*args), what
    with pytest.raises(TypeError):
        check(a)


def _subclass(t):
    """``t`` as a tensor subclass that dispatches (``__torch_dispatch__``): DTensor's kind."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(t, t.clone())


def test_checkpointing():
    """True inside a non-reentrant checkpoint, its forward and its recomputation; False under other
    saved-tensor hooks and outside."""
    import torch.utils.checkpoint as cp

    seen = []

    def f(x):
        seen.append(_compat.checkpointing())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    cp.checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not _compat.checkpointing()
    assert not _compat.checkpointing()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA device and stream")
def test_device_and_stream():
    assert _compat.current_device() == torch.cuda.current_device()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert _compat.raw_stream(torch.cuda.current_device()) == s.cuda_stream


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile stack warns about its own internals
def test_mark_dynamo_constant_is_what_assume_constant_result_sets():
    """The attribute torch.compiler.assume_constant_result sets, and dynamo calls the function rather
    than tracing it."""
    def probe():
        return 3

    marked = torch.compiler.assume_constant_result(lambda: 3)
    attrs = {k for k, v in vars(marked).items() if v is True}
    assert _compat.mark_dynamo_constant(probe) is probe
    assert {k for k, v in vars(probe).items() if v is True} == attrs

    calls = []

    def counted():
        calls.append(1)
        return 2

    _compat.mark_dynamo_constant(counted)
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * counted(), backend="eager", fullgraph=True)
    assert float(f(torch.ones(1))[0]) == 2.0
    assert calls  # called (as a constant), not traced into the graph


def test_dtensor_strategy_helpers_exist():
    """The DTensor internals the sharding registration uses (tests/test_distributed_torch.py runs it)."""
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo  # noqa: F401
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy  # noqa: F401
    from torch.distributed.tensor import DTensor

    assert callable(DTensor._op_dispatcher.sharding_propagator.register_op_strategy)
    assert callable(OpSchema.get_mesh_from_args)


def test_triton_launch_entries():
    """normkit/_compat.py's launch entries: the hook check, and the direct launch refusing a Triton
    release it was not written for (its launch is checked against Triton's own on a GPU:
    tests/test_torch.py::test_bound_launches_match_tritons_launcher_and_respect_alignment)."""
    import triton

    from normkit import _compat as triton_compat

    assert triton_compat.launch_hooks_active() is False
    from triton import knobs

    saved = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda meta: None
    try:
        assert triton_compat.launch_hooks_active() is True
    finally:
        knobs.runtime.launch_enter_hook = saved
    if not triton.__version__.startswith(triton_compat.DIRECT_LAUNCH_TRITON):
        assert triton_compat.direct_launch(object(), 1, (), ()) is None
    else:
        assert triton_compat.direct_launch(object(), 1, (), ()) is None  # not a compiled kernel: refused


def test_peft_input_conversion_entries():
    """PEFT's LoRA layer converts its input through ``_cast_input_dtype``; ``set_peft_cast`` puts another
    conversion in its place on one layer, and ``restore_peft_cast`` gives PEFT's back."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                                peft.LoraConfig(r=2, target_modules=["0"]))
    layer = model.base_model.model[0]
    assert _compat.peft_casts_input(layer) and not _compat.peft_casts_input(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(_compat.peft_cast(layer, x, torch.float32), x.float())
    seen = []

    def conversion(self, x, dtype):
        seen.append(self)
        return _compat.peft_cast(self, x, dtype)

    _compat.set_peft_cast(layer, conversion)
    assert torch.equal(layer._cast_input_dtype(x, torch.float32), x.float()) and seen == [layer]
    layer(x.float())  # the layer's forward calls it too
    assert len(seen) == 2
    assert _compat.restore_peft_cast(layer) and not _compat.restore_peft_cast(layer)
    layer(x.float())
    assert len(seen) == 2
