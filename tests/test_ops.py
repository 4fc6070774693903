"""The ``torch.ops.twell`` operators on their own: registration, numerics, gradients, autocast, errors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import twell_compile  # noqa: F401  (registers torch.ops.twell.*)
from twell_compile import ops, validation
from helpers import eager_gated, eager_relu

HIDDEN, INTER = 8, 16

gated_op = torch.ops.twell.gated_relu_mlp.default
relu_op = torch.ops.twell.relu_mlp.default


def _x(ndim: int, dtype=torch.float32, tokens: int = 5, hidden: int = HIDDEN) -> torch.Tensor:
    shape = {1: (hidden,), 2: (tokens, hidden), 3: (2, tokens, hidden)}[ndim]
    return torch.randn(shape, dtype=dtype)


def gated_args(ndim=2, dtype=torch.float32, bias=True, tokens=5, hidden=HIDDEN, inter=INTER):
    """(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias), nn.Linear layouts."""
    scale = hidden**-0.5
    return (
        _x(ndim, dtype, tokens, hidden),
        torch.randn(inter, hidden, dtype=dtype) * scale,
        torch.randn(inter, hidden, dtype=dtype) * scale,
        torch.randn(hidden, inter, dtype=dtype) * inter**-0.5,
        torch.randn(inter, dtype=dtype) if bias else None,
        torch.randn(inter, dtype=dtype) if bias else None,
        torch.randn(hidden, dtype=dtype) if bias else None,
    )


def relu_args(ndim=2, dtype=torch.float32, bias=True, tokens=5, hidden=HIDDEN, inter=INTER):
    """(x, up_weight, down_weight, up_bias, down_bias), nn.Linear layouts."""
    return (
        _x(ndim, dtype, tokens, hidden),
        torch.randn(inter, hidden, dtype=dtype) * hidden**-0.5,
        torch.randn(hidden, inter, dtype=dtype) * inter**-0.5,
        torch.randn(inter, dtype=dtype) if bias else None,
        torch.randn(hidden, dtype=dtype) if bias else None,
    )


# Each case: (op, builder of its arguments, the same math in eager PyTorch).
OPS = {
    "gated": (gated_op, gated_args, eager_gated),
    "relu": (relu_op, relu_args, eager_relu),
}
op_names = pytest.mark.parametrize("name", list(OPS))


def requiring_grad(args):
    return tuple(a.detach().clone().requires_grad_() if a is not None else None for a in args)


# ---------------------------------------------------------------------------------------------------
# registration: schema, fake kernel, autograd registration, AOT dispatch
# ---------------------------------------------------------------------------------------------------


@op_names
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_opcheck(name, dtype, ndim, bias):
    op, make_args, _ = OPS[name]
    args = requiring_grad(make_args(ndim, dtype, bias))
    torch.library.opcheck(op, args)  # raises on any failed check


@op_names
def test_opcheck_without_grad(name):
    op, make_args, _ = OPS[name]
    torch.library.opcheck(op, make_args(3, torch.float32, True))


def test_opcheck_with_row_slices_of_a_fused_weight():
    # What the pass hands the op for a fused gate-and-up projection (passes/fused_projection.py): views
    # of one weight and one bias, the up slice at a storage offset. Gradients reach the fused leaves.
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = gated_args(3)
    fused_weight = torch.cat([up_weight, gate_weight]).requires_grad_()
    fused_bias = torch.cat([up_bias, gate_bias]).requires_grad_()
    args = (x.requires_grad_(), fused_weight[INTER:], fused_weight[:INTER], down_weight.requires_grad_(),
            fused_bias[INTER:], fused_bias[:INTER], down_bias.requires_grad_())
    assert args[2].storage_offset() == 0 and args[1].storage_offset() == INTER * HIDDEN
    torch.library.opcheck(gated_op, args)
    out = gated_op(*args)
    expected = eager_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    assert fused_weight.grad is not None and fused_bias.grad is not None


@op_names
def test_schema_is_functional(name):
    op, _, _ = OPS[name]
    schema = op._schema
    assert not schema.is_mutable
    assert all(arg.alias_info is None for arg in schema.arguments)
    assert len(schema.returns) == 1 and schema.returns[0].alias_info is None


@op_names
def test_kernels_registered_for_every_dispatch_key(name):
    op, _, _ = OPS[name]
    for key in ("CompositeExplicitAutograd", "CUDA", "Meta", "Autograd", "AutocastCPU", "AutocastCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), key
    assert torch.Tag.pt2_compliant_tag in op.tags


def _count_redispatches(monkeypatch) -> list:
    calls = []
    original = torch._ops.OpOverload.redispatch

    def counting(self, keyset, *args, **kwargs):
        calls.append(self)
        return original(self, keyset, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", counting)
    return calls


@op_names
def test_call_needing_no_gradient_runs_the_device_kernel_directly(name, monkeypatch):
    # autograd_kernel.py: no second trip through the dispatcher where it would reach the CPU kernel anyway.
    op, make_args, eager = OPS[name]
    args = make_args(3, torch.float32, True)
    redispatched = _count_redispatches(monkeypatch)
    with torch.no_grad():
        assert torch.equal(op(*args), eager(*args))
    assert torch.equal(op(*args), eager(*args))  # grad mode on, but nothing requires a gradient
    with torch.inference_mode():  # no Autograd key at all
        assert torch.equal(op(*args), eager(*args))
    assert redispatched == []


@op_names
def test_calls_with_other_keys_below_autograd_still_redispatch(name, monkeypatch):
    # Fake tensors (the Python key) and meta tensors must reach their own kernels, not the CPU one.
    op, make_args, _ = OPS[name]
    args = make_args(3, torch.float32, True)
    redispatched = _count_redispatches(monkeypatch)
    with torch.no_grad():
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) for a in args))
        meta = op(*(a.to("meta") for a in args))
    assert fake.shape == meta.shape == args[0].shape and meta.device.type == "meta"
    assert op in redispatched and len(redispatched) >= 2


@op_names
def test_call_needing_gradients_with_omitted_biases(name, monkeypatch):
    # The dispatcher drops trailing arguments equal to their defaults; the autograd function's
    # setup_context still gets every argument and the backward one gradient per argument passed.
    op, make_args, eager = OPS[name]
    n_weights = 3 if name == "gated" else 2
    ours = requiring_grad(make_args(2, torch.float64, False)[: 1 + n_weights])
    theirs = requiring_grad(ours)
    redispatched = _count_redispatches(monkeypatch)
    op(*ours).square().sum().backward()
    assert redispatched == [op]
    eager(*theirs).square().sum().backward()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m, i=i: f"argument {i}: {m}")


def test_cuda_kernels_hand_their_arguments_to_the_twell_path(monkeypatch):
    # The CUDA registrations run on the GPU only; here they run on CPU tensors, with the kernels
    # reported available and the TwELL entry replaced, to pin which argument goes where.
    from twell_compile.kernels import build, twell_mlp

    calls = []
    monkeypatch.setattr(build, "kernels_available", lambda device: True)
    monkeypatch.setattr(twell_mlp, "twell_mlp", lambda *args: calls.append(args) or args[0])
    x, gate_w, up_w, down_w, gate_b, up_b, down_b = gated_args(2, torch.bfloat16, True)
    ops._gated_cuda(x, gate_w, up_w, down_w, gate_b, up_b, down_b)
    x2, up_w2, down_w2, up_b2, down_b2 = relu_args(2, torch.float16, True)
    ops._relu_cuda(x2, up_w2, down_w2, up_b2, down_b2)
    expected = [(x, gate_w, gate_b, up_w, up_b, down_w, down_b), (x2, up_w2, up_b2, None, None, down_w2, down_b2)]
    assert len(calls) == 2
    for call, want in zip(calls, expected):
        assert all(a is b for a, b in zip(call, want, strict=True))


@op_names
def test_cuda_kernels_take_the_reference_for_float32(name, monkeypatch):
    from twell_compile.kernels import build

    monkeypatch.setattr(build, "kernels_available", lambda device: True)
    _, make_args, eager = OPS[name]
    args = make_args(3, torch.float32, True)
    assert torch.equal({"gated": ops._gated_cuda, "relu": ops._relu_cuda}[name](*args), eager(*args))


@pytest.mark.parametrize("sizes", [(0, 16, 4), (8, 0, 4), (8, 16, 0)], ids=["no_inputs", "no_units", "no_outputs"])
def test_zero_sizes_are_exact_forward_and_backward(sizes, monkeypatch):
    """No input features, units or outputs: the output is arithmetic on the biases (or empty), as eager
    gives it, gradients included; the CUDA kernels (stood in for, as above) never see such a call."""
    import torch.nn.functional as F

    from twell_compile.kernels import build, twell_mlp

    k, f, d = sizes
    monkeypatch.setattr(build, "kernels_available", lambda device: True)
    monkeypatch.setattr(twell_mlp, "twell_mlp", lambda *args: pytest.fail("zero sizes reach the kernels"))
    shapes = [(3, k), (f, k), (f, k), (d, f), (f,), (f,), (d,)]
    args = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    same = [a.detach().clone().requires_grad_() for a in args]
    out = torch.ops.twell.gated_relu_mlp(*args)
    x, gate_w, up_w, down_w, gate_b, up_b, down_b = same
    expected = F.linear(F.relu(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for got, want in zip(args, same):
        torch.testing.assert_close(got.grad, want.grad)
    half = [a.detach().to(torch.bfloat16) for a in args]
    assert ops._gated_cuda(*half).shape == (3, d)
    assert ops._relu_cuda(half[0], half[2], half[3], half[5], half[6]).shape == (3, d)


# ---------------------------------------------------------------------------------------------------
# forward numerics
# ---------------------------------------------------------------------------------------------------


@op_names
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_forward_bit_exact_float32_cpu(name, ndim, bias):
    # The CPU path runs the same ops as the unrewritten model, so it must agree to the last bit.
    op, make_args, eager = OPS[name]
    args = make_args(ndim, torch.float32, bias)
    out = op(*args)
    expected = eager(*args)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert torch.equal(out, expected)


@op_names
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_forward_other_dtypes(name, dtype):
    op, make_args, eager = OPS[name]
    args = make_args(3, dtype, True)
    out = op(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, eager(*args), rtol=0, atol=0)


@op_names
def test_output_is_contiguous_for_non_contiguous_input(name):
    op, make_args, eager = OPS[name]
    args = make_args(3, torch.float32, True)
    x_t = args[0].transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous strides
    assert not x_t.is_contiguous()
    out = op(x_t, *args[1:])
    assert out.is_contiguous()
    assert torch.equal(out, eager(*args))


@op_names
@pytest.mark.parametrize("ndim", [2, 3])
def test_zero_tokens(name, ndim):
    op, make_args, eager = OPS[name]
    args = requiring_grad(make_args(ndim, torch.float32, True, tokens=0))
    out = op(*args)
    assert out.shape == (*args[0].shape[:-1], HIDDEN)
    assert out.numel() == 0
    out.sum().backward()
    assert args[0].grad.shape == args[0].shape
    for w in args[1:]:
        assert w.grad is not None and w.grad.shape == w.shape
        assert torch.count_nonzero(w.grad) == 0  # no tokens: no gradient


@op_names
@pytest.mark.parametrize("ndim", [2, 3])
def test_output_never_aliases_inputs(name, ndim):
    op, make_args, _ = OPS[name]
    args = make_args(ndim, torch.float32, True, hidden=HIDDEN, inter=HIDDEN)  # square weights
    out = op(*args)
    out_storage = out.untyped_storage().data_ptr()
    for a in args:
        assert a.untyped_storage().data_ptr() != out_storage
    # Writing to the output leaves every input as it was.
    before = [a.clone() for a in args]
    out.fill_(123.0)
    assert all(torch.equal(a, b) for a, b in zip(args, before))


# ---------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------


@op_names
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gradcheck_float64(name, ndim, bias):
    op, make_args, _ = OPS[name]
    args = requiring_grad(make_args(ndim, torch.float64, bias, tokens=3, hidden=4, inter=6))
    assert torch.autograd.gradcheck(op, args, eps=1e-6, atol=1e-5, rtol=1e-4)


@op_names
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float64, dict(rtol=1e-12, atol=1e-12)), (torch.float32, dict(rtol=1e-5, atol=1e-5))],
    ids=["f64", "f32"],
)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_every_gradient_matches_eager_autograd(name, dtype, tol, ndim, bias):
    op, make_args, eager = OPS[name]
    base = make_args(ndim, dtype, bias, tokens=7)
    ours, theirs = requiring_grad(base), requiring_grad(base)
    grad_out = torch.randn(*base[0].shape[:-1], HIDDEN, dtype=dtype)
    op(*ours).backward(grad_out)
    eager(*theirs).backward(grad_out)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if b is None:
            assert a is None
            continue
        assert a.grad is not None, f"argument {i} got no gradient"
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, i=i: f"gradient of argument {i}: {m}", **tol)


@op_names
def test_gradients_only_where_needed(name):
    # Frozen weights (inference, LoRA-style fine-tuning): only x and the biases ask for gradients.
    op, make_args, eager = OPS[name]
    base = make_args(3, torch.float64, True)
    n_weights = 3 if name == "gated" else 2
    ours = tuple(
        a.detach().clone().requires_grad_(i == 0 or i > n_weights) for i, a in enumerate(base)
    )
    theirs = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in ours)
    op(*ours).square().sum().backward()
    eager(*theirs).square().sum().backward()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if 1 <= i <= n_weights:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


@op_names
def test_gradgradcheck_float64(name):
    # The backward is written in differentiable PyTorch ops, so second derivatives (e.g. for
    # gradient penalties) are right too.
    op, make_args, _ = OPS[name]
    args = requiring_grad(make_args(2, torch.float64, True, tokens=3, hidden=4, inter=6))
    assert torch.autograd.gradgradcheck(op, args, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# autocast
# ---------------------------------------------------------------------------------------------------


@op_names
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_autocast_cpu_bfloat16(name, bias):
    op, make_args, eager = OPS[name]
    base = make_args(3, torch.float32, bias)
    ours, theirs = requiring_grad(base), requiring_grad(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(*ours)
        expected = eager(*theirs)
    assert expected.dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16
    # Autocast casts every input to bf16 just as it does for each F.linear, so the math is the same.
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    for a, b in zip(ours, theirs):
        if b is None:
            continue
        assert a.grad.dtype == torch.float32  # gradients come back in the parameters' dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)


@op_names
def test_autocast_leaves_float64_alone(name):
    op, make_args, eager = OPS[name]
    args = make_args(2, torch.float64, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(*args)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, eager(*args), rtol=0, atol=0)


def test_autocast_dtype_is_read_at_call_time():
    args = gated_args(2, torch.float32, True)
    with torch.autocast("cpu", dtype=torch.float16):
        assert gated_op(*args).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gated_op(*args).dtype == torch.bfloat16
    assert gated_op(*args).dtype == torch.float32


def test_autocast_casting_cuda_weights_warns_once(recwarn):
    """Under autocast a CUDA call's float32 weights are cast anew each call, which defeats the kernels'
    per-weight state: said once, with the cure. Weights already in the autocast dtype, float64 ones,
    and CPU calls (the reference path keeps no such state) say nothing."""
    import warnings

    from twell_compile import ops

    ops._warn_weight_casts_once.cache_clear()
    bf16 = [torch.zeros(2, 2, dtype=torch.bfloat16)]
    ops.note_weight_casts(bf16 + [None], torch.bfloat16, "cuda")
    ops.note_weight_casts([torch.zeros(2, 2, dtype=torch.float64)], torch.bfloat16, "cuda")
    ops.note_weight_casts([torch.zeros(2, 2)], torch.bfloat16, "cpu")
    assert not recwarn.list
    with pytest.warns(RuntimeWarning, match=r"under torch.autocast the MLP weights are cast on every call.*model.to"):
        ops.note_weight_casts(bf16 + [torch.zeros(2, 2)], torch.bfloat16, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        ops.note_weight_casts([torch.zeros(2, 2)], torch.float16, "cuda")
    ops._warn_weight_casts_once.cache_clear()


# ---------------------------------------------------------------------------------------------------
# errors: clear messages, both when running and when tracing with fake tensors
# ---------------------------------------------------------------------------------------------------


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return tuple(args)


GATED_ERRORS = [
    (
        "x_last_dim",
        lambda a: _replace(a, 0, torch.randn(5, HIDDEN + 1)),
        r"twell\.gated_relu_mlp: x has 9 features in its last dim but gate_weight expects 8",
    ),
    (
        "gate_vs_up",
        lambda a: _replace(_replace(a, 2, torch.randn(INTER - 4, HIDDEN)), 5, torch.randn(INTER - 4)),
        r"gate_weight \(16, 8\) and up_weight \(12, 8\) must have the same shape",
    ),
    (
        "down_in_features",
        lambda a: _replace(a, 3, torch.randn(HIDDEN, INTER - 1)),
        r"down_weight \(8, 15\) must take 16 input features",
    ),
    (
        "gate_bias_length",
        lambda a: _replace(a, 4, torch.randn(INTER - 1)),
        r"gate_bias has 15 elements but gate_weight has 16 output features",
    ),
    (
        "up_bias_length",
        lambda a: _replace(a, 5, torch.randn(INTER + 1)),
        r"up_bias has 17 elements but up_weight has 16 output features",
    ),
    (
        "down_bias_length",
        lambda a: _replace(a, 6, torch.randn(HIDDEN + 2)),
        r"down_bias has 10 elements but down_weight has 8 output features",
    ),
    (
        "bias_not_1d",
        lambda a: _replace(a, 4, torch.randn(1, INTER)),
        r"gate_bias must be 1-D, got shape \(1, 16\)",
    ),
    (
        "weight_not_2d",
        lambda a: _replace(a, 1, torch.randn(INTER, HIDDEN, 1)),
        r"gate_weight must be 2-D \[out_features, in_features\], got shape \(16, 8, 1\)",
    ),
    (
        "weight_dtype",
        lambda a: _replace(a, 2, a[2].double()),
        r"up_weight has dtype torch\.float64 but x has dtype torch\.float32; all inputs must share one dtype",
    ),
    (
        "bias_dtype",
        lambda a: _replace(a, 6, a[6].half()),
        r"down_bias has dtype torch\.float16 but x has dtype torch\.float32",
    ),
    (
        "x_dtype_int",
        lambda a: _replace(a, 0, torch.ones(5, HIDDEN, dtype=torch.int32)),
        r"x has dtype torch\.int32; supported dtypes are float32, float16, bfloat16 and float64",
    ),
    (
        "x_0d",
        lambda a: _replace(a, 0, torch.tensor(1.0)),
        r"twell\.gated_relu_mlp: x must have at least one dimension, got a 0-d tensor",
    ),
]

RELU_ERRORS = [
    (
        "x_last_dim",
        lambda a: _replace(a, 0, torch.randn(2, 5, HIDDEN - 1)),
        r"twell\.relu_mlp: x has 7 features in its last dim but up_weight expects 8",
    ),
    (
        "down_in_features",
        lambda a: _replace(a, 2, torch.randn(HIDDEN, INTER + 3)),
        r"twell\.relu_mlp: down_weight \(8, 19\) must take 16 input features",
    ),
    (
        "up_bias_length",
        lambda a: _replace(a, 3, torch.randn(INTER - 2)),
        r"up_bias has 14 elements but up_weight has 16 output features",
    ),
    (
        "down_bias_length",
        lambda a: _replace(a, 4, torch.randn(HIDDEN - 1)),
        r"down_bias has 7 elements but down_weight has 8 output features",
    ),
    (
        "weight_dtype",
        lambda a: _replace(a, 1, a[1].bfloat16()),
        r"twell\.relu_mlp: up_weight has dtype torch\.bfloat16 but x has dtype torch\.float32",
    ),
    (
        "x_0d",
        lambda a: _replace(a, 0, torch.tensor(2.0)),
        r"twell\.relu_mlp: x must have at least one dimension, got a 0-d tensor",
    ),
]

ERROR_CASES = [pytest.param("gated", *c[1:], id=f"gated-{c[0]}") for c in GATED_ERRORS] + [
    pytest.param("relu", *c[1:], id=f"relu-{c[0]}") for c in RELU_ERRORS
]


@pytest.mark.parametrize("name, corrupt, message", ERROR_CASES)
def test_bad_inputs_raise_clear_errors(name, corrupt, message):
    op, make_args, _ = OPS[name]
    args = corrupt(make_args(2, torch.float32, True))
    with pytest.raises(ValueError, match=message):
        op(*args)


@pytest.mark.parametrize("name, corrupt, message", ERROR_CASES)
def test_bad_inputs_fail_while_tracing(name, corrupt, message):
    # The fake kernel runs the same checks, so a bad graph fails at compile time with the same message.
    op, make_args, _ = OPS[name]
    args = corrupt(make_args(2, torch.float32, True))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if a is not None else None for a in args]
        with pytest.raises(ValueError, match=message):
            op(*fake_args)


@op_names
def test_fake_kernel_shape(name):
    op, make_args, _ = OPS[name]
    args = make_args(3, torch.bfloat16, True, tokens=11)
    with FakeTensorMode() as mode:
        out = op(*(mode.from_tensor(a) for a in args))
    assert out.shape == (2, 11, HIDDEN) and out.dtype == torch.bfloat16


# The device kernels (real tensors, eager) check with one pass of plain comparisons and run the full
# check above, which names the problem, only when that pass fails: it must refuse every bad call the full
# check refuses, and accept the good ones (else every call would pay for the slow check).
FAST_OK = {"gated": validation._gated_ok, "relu": validation._non_gated_ok}


@pytest.mark.parametrize("name, corrupt, message", ERROR_CASES)
def test_fast_check_refuses_every_bad_call(name, corrupt, message):
    _, make_args, _ = OPS[name]
    assert not FAST_OK[name](*corrupt(make_args(2, torch.float32, True)))


@op_names
def test_fast_check_refuses_mixed_devices(name):
    _, make_args, _ = OPS[name]
    for i in range(1, len(make_args())):
        args = make_args(2, torch.float32, True)
        args = _replace(args, i, args[i].to("meta"))
        assert not FAST_OK[name](*args), i
        with pytest.raises(ValueError, match=r"is on device meta but x is on cpu"):
            getattr(validation, {"gated": "check_gated", "relu": "check_non_gated"}[name])(*args)


@op_names
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fast_check_accepts_good_calls(name, dtype, ndim, bias):
    _, make_args, _ = OPS[name]
    assert FAST_OK[name](*make_args(ndim, dtype, bias))


def test_cuda_kernels_run_with_the_inputs_device_current(monkeypatch):
    # A model spread over GPUs calls an op on cuda:1 while cuda:0 is current; the TwELL path must then
    # run with cuda:1 current (the Triton launches and the host code read the current device), and a call
    # on the current device must not switch at all. Stand-ins for the device API pin both.
    import contextlib
    import types

    from twell_compile import kernels
    from twell_compile.kernels import twell_mlp

    current = [0]
    switches = []

    @contextlib.contextmanager
    def device(d):
        switches.append(d)
        previous, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(twell_mlp, "twell_mlp", lambda x, *args: current[0])
    on_cuda1 = types.SimpleNamespace(device=torch.device("cuda", 1))
    on_cuda0 = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert kernels._twell_mlp_on_its_device(on_cuda1, None) == 1
    assert switches == [torch.device("cuda", 1)] and current[0] == 0
    assert kernels._twell_mlp_on_its_device(on_cuda0, None) == 0
    assert len(switches) == 1
