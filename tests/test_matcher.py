"""Tests of the ReLU MLP matcher and rewrite (``twell_compile.passes``) on every graph dialect.

Each test captures a small model as an FX graph (symbolic_trace, Dynamo, torch.export before and after
``run_decompositions()``, make_fx), runs the passes, and checks the rewrite counts, the reasons of
blocks left alone, and that the rewritten GraphModule computes what the original did.
"""

from __future__ import annotations

import operator
import types

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

# Importing twell_compile (any submodule) registers torch.ops.twell.*.
from twell_compile.passes import ReluMlpFusionPass, TwellPassManager, run_passes
from twell_compile.passes.fx_utils import clean_module_path, node_tensor_meta
from twell_compile.passes.linear_match import match_linear

aten = torch.ops.aten
TWELL_OPS = (torch.ops.twell.gated_relu_mlp.default, torch.ops.twell.relu_mlp.default)
D, F_, D_OUT = 8, 16, 12

# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "nn.ReLU": lambda: nn.ReLU(),
    "nn.ReLU(inplace)": lambda: nn.ReLU(inplace=True),
    "F.relu": lambda: F.relu,
    "F.relu(inplace)": lambda: lambda t: F.relu(t, inplace=True),
    "torch.relu": lambda: torch.relu,
    "torch.relu_": lambda: torch.relu_,
    "Tensor.relu": lambda: lambda t: t.relu(),
    "Tensor.relu_": lambda: lambda t: t.relu_(),
    "silu": lambda: nn.SiLU(),
    "gelu": lambda: F.gelu,
    "sigmoid": lambda: torch.sigmoid,
}
# ReLU by other names: clamp(t, min=0) without max, and clamp_min(t, 0), give relu's values exactly.
CLAMP_RELUS = {
    "Tensor.clamp(min=0)": lambda t: t.clamp(min=0),
    "torch.clamp(t, 0)": lambda t: torch.clamp(t, 0),
    "torch.clamp(min=0.0)": lambda t: torch.clamp(t, min=0.0),
    "torch.clamp_min": lambda t: torch.clamp_min(t, 0),
    "Tensor.clamp_min_": lambda t: t.clamp_min_(0),
    "Tensor.clip(min=0)": lambda t: t.clip(min=0),
    "Tensor.clamp_(min=0)": lambda t: t.clamp_(min=0),
}
ACTIVATIONS.update({name: (lambda fn=fn: fn) for name, fn in CLAMP_RELUS.items()})

MULS = {
    "operator": operator.mul,
    "torch.mul": torch.mul,
    "Tensor.mul": lambda a, b: a.mul(b),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` in a chosen spelling."""

    def __init__(self, act="nn.ReLU", mul="operator", swap=False, bias=(False, False, False),
                 functional=False, up_out=F_):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_, bias=bias[0])
        self.up_proj = nn.Linear(D, up_out, bias=bias[1])
        self.down_proj = nn.Linear(F_, D_OUT, bias=bias[2])
        self.act = ACTIVATIONS[act]()
        self.mul = MULS[mul]
        self.swap = swap
        self.functional = functional

    def linear(self, layer: nn.Linear, x):
        return F.linear(x, layer.weight, layer.bias) if self.functional else layer(x)

    def forward(self, x):
        gated = self.act(self.linear(self.gate_proj, x))
        up = self.linear(self.up_proj, x)
        hidden = self.mul(up, gated) if self.swap else self.mul(gated, up)
        return self.linear(self.down_proj, hidden)


class NonGatedMLP(nn.Module):
    """``down(act(up(x)))``."""

    def __init__(self, act="nn.ReLU", bias=(False, False), functional=False):
        super().__init__()
        self.up_proj = nn.Linear(D, F_, bias=bias[0])
        self.down_proj = nn.Linear(F_, D_OUT, bias=bias[1])
        self.act = ACTIVATIONS[act]()
        self.functional = functional

    def forward(self, x):
        if self.functional:
            return F.linear(self.act(F.linear(x, self.up_proj.weight, self.up_proj.bias)), self.down_proj.weight)
        return self.down_proj(self.act(self.up_proj(x)))


class Wrapped(nn.Module):
    """Puts the block at module path ``mlp`` and adds a residual, as a transformer layer would."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp
        self.proj = nn.Linear(D_OUT, D)

    def forward(self, x):
        return x + self.proj(self.mlp(x))


class Custom(nn.Module):
    """A block given as a function of (module, x), for the near-miss shapes."""

    def __init__(self, fn):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_)
        self.up_proj = nn.Linear(D, F_)
        self.down_proj = nn.Linear(F_, D_OUT)
        self.dropout = nn.Dropout(0.5)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


# ---------------------------------------------------------------------------------------------------
# Capture and checks
# ---------------------------------------------------------------------------------------------------

MODES = ("symbolic", "dynamo", "export", "export_decomposed")


def capture(mode: str, model: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, tuple]:
    """The model's graph in the given dialect, and the inputs to call that graph with."""
    model.eval()
    if mode == "symbolic":
        return fx.symbolic_trace(model), args
    if mode == "dynamo":
        graphs = []

        def record(gm, example_inputs):
            graphs.append((gm, tuple(example_inputs)))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(model, backend=record, fullgraph=True)(*args)
        assert len(graphs) == 1
        return graphs[0]
    exported = torch.export.export(model, args)
    if mode == "export_decomposed":
        exported = exported.run_decompositions()
    return exported.module(), args


def outputs(gm: fx.GraphModule, inputs: tuple) -> list[torch.Tensor]:
    with torch.no_grad():
        out = gm(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def twell_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in TWELL_OPS]


def rewrite(gm: fx.GraphModule, inputs: tuple, rewritten: int, options=None, left_alone: int | None = None):
    """Runs the passes, checks the counts, and that the graph computes what it did before."""
    expected = outputs(gm, inputs)
    report = run_passes(gm, options)
    assert report.rewritten_count == rewritten, str(report)
    if left_alone is not None:
        assert report.left_alone_count == left_alone, str(report)
    assert len(twell_calls(gm)) == rewritten, gm.code
    for got, want in zip(outputs(gm, inputs), expected, strict=True):
        torch.testing.assert_close(got, want)
    return report


def assert_left_alone(report, *reason_parts: str, kind: str | None = None) -> None:
    assert report.rewritten_count == 0, str(report)
    assert report.left_alone_count >= 1, str(report)
    reasons = " | ".join(report.reasons)
    for part in reason_parts:
        assert part in reasons, str(report)
    if kind is not None:
        assert all(c.kind == kind for c in report.left_alone), str(report)


def x3d() -> torch.Tensor:
    return torch.randn(2, 3, D)


# ---------------------------------------------------------------------------------------------------
# Spellings that must be rewritten
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [(False, False, False), (True, True, True)], ids=["no_bias", "bias"])
def test_gated_every_dialect(mode, bias):
    gm, inputs = capture(mode, Wrapped(GatedMLP(bias=bias)), x3d())
    report = rewrite(gm, inputs, rewritten=1, left_alone=0)
    (candidate,) = report.candidates
    assert candidate.kind == "gated" and candidate.module_path == "mlp"
    (call,) = twell_calls(gm)
    assert call.target is torch.ops.twell.gated_relu_mlp.default
    assert len(call.args) == 7  # biases passed positionally, None where absent
    assert (call.args[4] is None) == (not bias[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(5, D), (2, 3, D)], ids=["2d", "3d"])
def test_non_gated_every_dialect(mode, shape):
    gm, inputs = capture(mode, Wrapped(NonGatedMLP(bias=(True, False))), torch.randn(*shape))
    report = rewrite(gm, inputs, rewritten=1, left_alone=0)
    assert report.candidates[0].kind == "non_gated"
    (call,) = twell_calls(gm)
    assert call.target is torch.ops.twell.relu_mlp.default
    assert call.args[3] is not None and call.args[4] is None


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if "relu" in a.lower()])
def test_relu_spellings(mode, act):
    gm, inputs = capture(mode, GatedMLP(act=act), x3d())
    rewrite(gm, inputs, rewritten=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act", list(CLAMP_RELUS))
def test_clamp_at_zero_is_relu_without_gradients(mode, act):
    with torch.no_grad():
        gm, inputs = capture(mode, Wrapped(GatedMLP(act=act, bias=(True, True, True))), x3d())
        rewrite(gm, inputs, rewritten=1, left_alone=0)
        gm, inputs = capture(mode, Wrapped(NonGatedMLP(act=act)), x3d())
        rewrite(gm, inputs, rewritten=1, left_alone=0)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
def test_clamp_at_zero_is_left_alone_where_gradients_may_flow(mode):
    """clamp(t, min=0) passes the gradient at exactly 0 (an all-zero padding row after a norm gives
    that), relu does not, and the twell ops' backward is relu's."""
    gm, inputs = capture(mode, Wrapped(GatedMLP(act="Tensor.clamp(min=0)")), x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0), "relu spelled as a clamp", kind="gated")


def test_clamp_matches_relu_values():
    t = torch.tensor([float("nan"), -0.0, 0.0, -1.0, 2.5, float("-inf"), float("inf")])
    for fn in CLAMP_RELUS.values():
        assert torch.equal(fn(t.clone()).view(torch.int32), torch.relu(t).view(torch.int32))


@pytest.mark.parametrize("mode", ["symbolic", "dynamo", "export_decomposed"])
@pytest.mark.parametrize("clamp", [lambda t: t.clamp(min=0.5), lambda t: torch.clamp(t, 0, 6),
                                   lambda t: t.clamp(max=0), lambda t: torch.clamp_min(t, -1)],
                         ids=["min_0.5", "min_0_max_6", "max_0", "clamp_min_-1"])
def test_other_clamps_left_alone(mode, clamp):
    model = Custom(lambda m, x: m.down_proj(clamp(m.gate_proj(x)) * m.up_proj(x)))
    gm, inputs = capture(mode, model, x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0), "activation is clamp, not relu", kind="gated")


# Hand-written products with the weight in nn.Linear layout [out_features, in_features].
HANDWRITTEN_LINEARS = {
    "x @ W.T": lambda x, w: x @ w.T,
    "torch.matmul(x, W.t())": lambda x, w: torch.matmul(x, w.t()),
    "x.matmul(W.transpose(0, 1))": lambda x, w: x.matmul(w.transpose(0, 1)),
    "x @ W.mT": lambda x, w: x @ w.mT,
    "x @ W.permute(1, 0)": lambda x, w: x @ w.permute(1, 0),
    "x @ torch.transpose(W, -1, -2)": lambda x, w: x @ torch.transpose(w, -1, -2),
    "torch.mm(x, torch.t(W))": lambda x, w: torch.mm(x, torch.t(w)),  # 2-D x only
}


class HandwrittenMLP(nn.Module):
    """``down(relu(gate(x)) * up(x))`` (or non-gated) on raw parameters, each projection ``linear(x, W) + b``."""

    def __init__(self, linear: str, gated: bool = True, bias: bool = False, transposed_down: bool = True):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(F_, D) * D**-0.5) if gated else None
        self.up = nn.Parameter(torch.randn(F_, D) * D**-0.5)
        # transposed_down=False stores the down weight [in, out] and multiplies it as it is: no linear.
        down = torch.randn(D_OUT, F_) * F_**-0.5
        self.down = nn.Parameter(down if transposed_down else down.t().contiguous())
        self.biases = nn.ParameterList([nn.Parameter(torch.randn(n)) for n in (F_, F_, D_OUT)] if bias else [])
        self.linear = HANDWRITTEN_LINEARS[linear]
        self.transposed_down = transposed_down

    def project(self, x, weight, i):
        y = self.linear(x, weight)
        return y + self.biases[i] if len(self.biases) else y

    def forward(self, x):
        if self.gate is not None:
            hidden = torch.relu(self.project(x, self.gate, 0)) * self.project(x, self.up, 1)
        else:
            hidden = torch.relu(self.project(x, self.up, 1))
        if not self.transposed_down:
            return hidden @ self.down
        return self.project(hidden, self.down, 2)


def capture_with_shapes(mode: str, model: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, tuple]:
    """``capture``, with shapes propagated through symbolic_trace graphs (a bias add needs them)."""
    gm, inputs = capture(mode, model, *args)
    if mode == "symbolic":
        ShapeProp(gm).propagate(*inputs)
    return gm, inputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("linear", list(HANDWRITTEN_LINEARS))
def test_handwritten_linears(mode, linear):
    x = torch.randn(5, D) if "torch.mm" in linear else x3d()
    gm, inputs = capture_with_shapes(mode, Wrapped(HandwrittenMLP(linear, bias=True)), x)
    report = rewrite(gm, inputs, rewritten=1, left_alone=0)
    (call,) = twell_calls(gm)
    assert call.target is torch.ops.twell.gated_relu_mlp.default and all(a is not None for a in call.args)
    assert report.candidates[0].kind == "gated"
    gm, inputs = capture_with_shapes(mode, HandwrittenMLP(linear, gated=False), torch.randn(5, D))
    rewrite(gm, inputs, rewritten=1, left_alone=0)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo", "export_decomposed"])
def test_untransposed_weight_is_no_linear(mode):
    # hidden @ W_down with W_down stored [in, out]: the op takes nn.Linear layouts, so nothing matches.
    gm, inputs = capture_with_shapes(mode, HandwrittenMLP("x @ W.T", transposed_down=False), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert report.left_alone_count == 0, str(report)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
@pytest.mark.parametrize("mul", list(MULS))
@pytest.mark.parametrize("swap", [False, True], ids=["relu_first", "up_first"])
def test_mul_spellings_either_order(mode, mul, swap):
    gm, inputs = capture(mode, GatedMLP(mul=mul, swap=swap), x3d())
    rewrite(gm, inputs, rewritten=1)


@pytest.mark.parametrize("bias", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["gate_bias", "up_bias", "down_bias"])
@pytest.mark.parametrize("functional", [False, True], ids=["nn.Linear", "F.linear"])
def test_bias_on_each_linear(bias, functional):
    gm, inputs = capture("symbolic", GatedMLP(bias=bias, functional=functional), x3d())
    rewrite(gm, inputs, rewritten=1)
    (call,) = twell_calls(gm)
    assert [a is not None for a in call.args[4:]] == list(bias)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo", "export_decomposed"])
@pytest.mark.parametrize("shape", [(5, D), (2, 2, 3, D)], ids=["2d", "4d"])
def test_input_ranks(mode, shape):
    gm, inputs = capture(mode, GatedMLP(bias=(True, False, True)), torch.randn(*shape))
    rewrite(gm, inputs, rewritten=1)


def test_dynamo_autocast_around_block():
    class Autocast(nn.Module):
        def __init__(self, inner_only_up: bool):
            super().__init__()
            self.mlp = GatedMLP(bias=(True, True, True))
            self.inner_only_up = inner_only_up

        def forward(self, x):
            m = self.mlp
            if self.inner_only_up:  # gate in float32, up in bfloat16: one fused call cannot do both
                gate = torch.relu(m.gate_proj(x))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return m.down_proj(gate * m.up_proj(x))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x)

    gm, inputs = capture("dynamo", Autocast(inner_only_up=False), x3d())
    rewrite(gm, inputs, rewritten=1)
    assert outputs(gm, inputs)[0].dtype == torch.bfloat16
    gm, inputs = capture("dynamo", Autocast(inner_only_up=True), x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0), "_enter_autocast")


@pytest.mark.parametrize("mode", ["dynamo", "export", "export_decomposed"])
@pytest.mark.parametrize("act", ["nn.ReLU(inplace)", "Tensor.relu_"])
def test_inplace_relu_functionalized(mode, act):
    # After run_decompositions an in-place relu leaves view(view(relu, 2-D), 3-D) round trips.
    gm, inputs = capture(mode, Wrapped(GatedMLP(act=act, bias=(True, True, True))), x3d())
    rewrite(gm, inputs, rewritten=1)
    gm, inputs = capture(mode, Wrapped(NonGatedMLP(act=act)), x3d())
    rewrite(gm, inputs, rewritten=1)


def test_functional_linear_with_module_parameters():
    # symbolic_trace: F.linear reads get_attr weights, whose shapes come from the module.
    gm, inputs = capture("symbolic", NonGatedMLP(act="F.relu", functional=True), x3d())
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    rewrite(gm, inputs, rewritten=1)


def test_export_dynamic_shapes_decomposed():
    model = Wrapped(GatedMLP(bias=(True, True, True))).eval()
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    exported = torch.export.export(model, (x3d(),), dynamic_shapes={"x": {0: batch, 1: seq}})
    gm = exported.run_decompositions().module()
    rewrite(gm, (torch.randn(4, 5, D),), rewritten=1)
    dead = [n.name for n in gm.graph.nodes if not n.users and n.op == "call_function"]
    assert dead == [], dead  # view sizes (sym_size) only the block used are gone too
    # The rewritten graph still takes other sizes.
    x = torch.randn(3, 7, D)
    torch.testing.assert_close(gm(x), model(x))


def test_dynamo_dynamic_shapes():
    model = Wrapped(GatedMLP())
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record, dynamic=True)(x3d())
    report = run_passes(graphs[0], None)
    assert report.rewritten_count == 1, str(report)
    (call,) = twell_calls(graphs[0])
    assert isinstance(call.meta["example_value"].shape[0], torch.SymInt)


def _make_fx_block(x, wg, bg, wu, wd, bd):
    """The decomposed spellings by hand: t / transpose / permute, _unsafe_view, mm + add bias."""
    x2d = aten.view.default(x, [-1, D])
    gate = aten.add.Tensor(aten.view.default(aten.mm.default(x2d, aten.t.default(wg)), [2, 3, F_]), bg)
    up = aten._unsafe_view.default(aten.mm.default(aten.view.default(x, [6, D]), aten.transpose.int(wu, 0, 1)),
                                   [2, 3, F_])
    hidden = aten.mul.Tensor(up, aten.relu.default(gate))
    down2d = aten.add.Tensor(bd, aten.mm.default(aten.reshape.default(hidden, [6, F_]),
                                                 aten.permute.default(wd, [1, 0])))
    return aten.view.default(down2d, [2, 3, D_OUT])


def test_make_fx_decomposed_spellings():
    args = (x3d(), torch.randn(F_, D), torch.randn(F_), torch.randn(F_, D), torch.randn(D_OUT, F_),
            torch.randn(D_OUT))
    gm = make_fx(_make_fx_block)(*args)
    targets = {n.target for n in gm.graph.nodes}
    assert {aten.t.default, aten.transpose.int, aten.permute.default, aten._unsafe_view.default} <= targets
    rewrite(gm, args, rewritten=1)
    (call,) = twell_calls(gm)
    assert call.args[4] is not None and call.args[5] is None and call.args[6] is not None
    assert tuple(call.meta["val"].shape) == (2, 3, D_OUT)


def test_bias_add_must_be_a_bias():
    # A residual added to mm's output is not a bias: the linear stops before it.
    def block(x, w):
        return aten.add.Tensor(aten.mm.default(x, aten.t.default(w)), x)

    gm = make_fx(block)(torch.randn(4, D), torch.randn(D, D))
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert match_linear(add, gm) is None
    assert match_linear(mm, gm).bias is None


def test_several_blocks_and_module_paths():
    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                [Wrapped(GatedMLP()), Wrapped(NonGatedMLP()), Wrapped(GatedMLP(act="silu"))])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    for mode in ("symbolic", "dynamo"):
        gm, inputs = capture(mode, Layers(), x3d())
        report = rewrite(gm, inputs, rewritten=2, left_alone=1)
        assert [c.module_path for c in report.candidates] == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
        assert report.per_layer_counts == {
            "layers.0": {"rewritten": 1, "left_alone": 0},
            "layers.1": {"rewritten": 1, "left_alone": 0},
            "layers.2": {"rewritten": 0, "left_alone": 1},
        }
        assert report.gated_count == 1 and report.non_gated_count == 1


def test_chained_blocks_rewrite_once():
    # up of the second block is the first block's down: both match, only the first may be rewritten.
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a_up, self.a_down = nn.Linear(D, F_), nn.Linear(F_, D)
            self.b_down = nn.Linear(D, D)

        def forward(self, x):
            return self.b_down(torch.relu(self.a_down(torch.relu(self.a_up(x)))))

    gm, inputs = capture("symbolic", Chain(), x3d())
    report = rewrite(gm, inputs, rewritten=1, left_alone=1)
    assert "rewritten first" in report.left_alone[0].reason


@pytest.mark.parametrize("path, expected", [
    ("L['self'].model.layers[0].mlp", "model.layers.0.mlp"),
    ("L['args'][0].model.layers[5].mlp", "model.layers.5.mlp"),  # a forward behind a *args decorator
    ("L['kwargs']['model'].layers[1]", "layers.1"),
    ("L['self']._modules['layers']._modules['2'].mlp", "layers.2.mlp"),
    ("L__self__.mlp", "mlp"),
    ("L['self']", ""),
    ("model.layers.3.mlp", "model.layers.3.mlp"),  # export paths pass through
])
def test_clean_module_path_strips_every_dynamo_root(path, expected):
    assert clean_module_path(path) == expected


def test_llama_dynamo_graph_is_fast():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=38, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, hidden_act="relu")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 50, (1, 4))
    gm, inputs = capture("dynamo", model, ids)
    report = rewrite(gm, inputs, rewritten=38, left_alone=0)
    assert report.elapsed_s < 1.0, report.elapsed_s
    assert report.candidates[5].module_path == "model.layers.5.mlp"
    assert len(report.per_layer_counts) == 38
    fused = twell_calls(gm)[0]
    assert fused.meta["stack_trace"]
    innermost_path, _ = list(fused.meta["nn_module_stack"].values())[-1]
    assert clean_module_path(innermost_path) == "model.layers.0.mlp"


# ---------------------------------------------------------------------------------------------------
# Gate and up as pieces of one fused projection (Phi-3, GLM: gate_up_proj(x).chunk(2, dim=-1))
# ---------------------------------------------------------------------------------------------------

FUSED_SPLITS = {
    "Tensor.chunk": lambda t: t.chunk(2, dim=-1),
    "torch.chunk": lambda t: torch.chunk(t, 2, -1),
    "Tensor.split": lambda t: t.split(F_, dim=-1),
    "torch.split(sizes)": lambda t: torch.split(t, [F_, F_], -1),
    "Tensor.split(dim=2)": lambda t: t.split(F_, 2),  # the last dim of a 3-D x, by its index
    "slices": lambda t: (t[..., :F_], t[..., F_:]),
    "slices(-F:)": lambda t: (t[:, :, 0:F_], t[..., -F_:]),
    "Tensor.narrow": lambda t: (t.narrow(-1, 0, F_), t.narrow(2, -F_, F_)),
}


class FusedGateUpMLP(nn.Module):
    """``gate, up = split(gate_up(x)); down(relu(gate) * up)``, gate the first piece or the second."""

    def __init__(self, split="Tensor.chunk", gate_second=False, bias=True, out_features=2 * F_):
        super().__init__()
        self.gate_up_proj = nn.Linear(D, out_features, bias=bias)
        self.down_proj = nn.Linear(F_, D_OUT, bias=bias)
        self.split = FUSED_SPLITS[split]
        self.gate_second = gate_second

    def forward(self, x):
        first, second = self.split(self.gate_up_proj(x))
        gate, up = (second, first) if self.gate_second else (first, second)
        return self.down_proj(up * torch.relu(gate))


def _fused_slices(call: fx.Node) -> list[tuple[int, int]]:
    """The (start, stop) rows each of the call's gate and up operands (weight, then bias) slices."""
    operands = [call.args[1], call.args[2], call.args[4], call.args[5]]
    assert all(o.target is aten.slice.Tensor and o.args[1] == 0 for o in operands if o is not None)
    return [tuple(o.args[2:]) for o in operands if o is not None]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", list(FUSED_SPLITS))
@pytest.mark.parametrize("gate_second", [False, True], ids=["gate_first", "gate_second"])
def test_fused_gate_up_every_dialect(mode, split, gate_second):
    # (With symbolic_trace, dim 2 is known to be the last only with shapes propagated.)
    gm, inputs = capture_with_shapes(mode, Wrapped(FusedGateUpMLP(split, gate_second)), x3d())
    report = rewrite(gm, inputs, rewritten=1, left_alone=0)
    assert report.candidates[0].kind == "gated" and report.candidates[0].module_path == "mlp"
    (call,) = twell_calls(gm)
    gate_rows, up_rows = ((F_, 2 * F_), (0, F_)) if gate_second else ((0, F_), (F_, 2 * F_))
    assert _fused_slices(call) == [gate_rows, up_rows, gate_rows, up_rows]
    # The fused projection, its split and its pieces are gone: one call reads slices of the weight.
    leftovers = [n for n in gm.graph.nodes if any(s in str(n.target) for s in ("chunk", "split", "narrow", "getitem"))]
    assert not leftovers, gm.code
    assert all(n.args[0].op in ("get_attr", "placeholder") for n in gm.graph.nodes if n.target is aten.slice.Tensor)


def test_fused_gate_up_without_bias_and_make_fx():
    def block(x, w_gate_up, w_down):
        gate, up = aten.split.Tensor(aten.linear.default(x, w_gate_up), F_, -1)
        return aten.linear.default(aten.mul.Tensor(aten.relu.default(gate), up), w_down)

    args = (x3d(), torch.randn(2 * F_, D), torch.randn(D_OUT, F_))
    gm = make_fx(block)(*args)
    rewrite(gm, args, rewritten=1, left_alone=0)
    (call,) = twell_calls(gm)
    assert _fused_slices(call) == [(0, F_), (F_, 2 * F_)] and call.args[4] is None and call.args[5] is None


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
def test_fused_piece_as_non_gated_up(mode):
    def block(m, x):
        _, up = m.gate_up_proj(x).chunk(2, dim=-1)  # symbolic_trace keeps the unread piece's getitem
        return m.down_proj(torch.relu(up))

    model = Custom(block)
    model.gate_up_proj = nn.Linear(D, 2 * F_)
    gm, inputs = capture(mode, model, x3d())
    rewrite(gm, inputs, rewritten=1, left_alone=0)
    (call,) = twell_calls(gm)
    assert call.target is torch.ops.twell.relu_mlp.default
    assert (call.args[1].args[2:], call.args[3].args[2:]) == ((F_, 2 * F_), (F_, 2 * F_))
    assert not [n for n in gm.graph.nodes if n.target is operator.getitem], gm.code


def test_fused_projection_passes_views_of_the_weight():
    # The op gets views of the fused weight (row slices of a contiguous weight are contiguous): no copy.
    model = FusedGateUpMLP()
    gm, inputs = capture("dynamo", model, x3d())
    run_passes(gm)
    seen = {}

    def spy(x, gate_weight, up_weight, *rest):
        seen["gate"], seen["up"] = gate_weight, up_weight
        return torch.ops.twell.gated_relu_mlp.default(x, gate_weight, up_weight, *rest)

    (call,) = twell_calls(gm)
    call.target = spy
    gm.recompile()
    gm(*inputs)
    weight = model.gate_up_proj.weight
    assert seen["gate"].is_contiguous() and seen["up"].is_contiguous()
    assert seen["gate"].data_ptr() == weight.data_ptr()
    assert seen["up"].data_ptr() == weight.data_ptr() + F_ * D * weight.element_size()


def _other_piece_used(m, x):
    gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    return m.down_proj(torch.relu(gate) * up) + up.sum()


def _third_piece_used(m, x):
    gate, up, extra = m.gate_up_proj(x).split(F_, dim=-1)
    return m.down_proj(torch.relu(gate) * up) + extra.sum()


def _split_along_tokens(m, x):
    # Halves of the tokens, not of the features (the down projection takes all 2F): no fused projection.
    gate, up = m.gate_up_proj(x).chunk(2, dim=0)
    return m.down_proj(torch.relu(gate) * up)


def _strided_slices(m, x):
    # Every other feature: W[::2] is no row slice the op could take as a view, so no match.
    gate_up = m.gate_up_proj(x)
    return m.down_proj(torch.relu(gate_up[..., ::2]) * gate_up[..., 1::2])


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
@pytest.mark.parametrize("case, out_features, reason", [
    (_other_piece_used, 2 * F_, ("the up projection output", "has another user: sum")),
    (_third_piece_used, 3 * F_, ("(split) has another user",)),
    (_split_along_tokens, 2 * F_, None),
    (_strided_slices, 2 * F_, None),
], ids=["other_piece_used", "third_piece_used", "split_along_tokens", "strided_slices"])
def test_fused_projection_left_alone(mode, case, out_features, reason):
    model = Custom(case)
    model.gate_up_proj = nn.Linear(D, out_features)
    if case is _split_along_tokens:
        model.down_proj = nn.Linear(out_features, D_OUT)
    gm, inputs = capture(mode, model, torch.randn(4, 3, D))
    report = rewrite(gm, inputs, rewritten=0)
    if reason is None:
        assert report.left_alone_count == 0, str(report)
    else:
        assert_left_alone(report, *reason, kind="gated")


def _inplace_relu_on_overlapping_pieces(m, x):
    # relu_ on the gate's piece also changes the first half of the up piece: the fused op would not.
    gate_up = m.gate_up_proj(x)
    gate, up = gate_up[..., :F_], gate_up[..., F_ // 2:F_ // 2 + F_]
    return m.down_proj(torch.relu_(gate) * up)


def _inplace_relu_on_disjoint_pieces(m, x):
    gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    return m.down_proj(torch.relu_(gate) * up)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo", "export"])
def test_inplace_relu_on_overlapping_pieces_left_alone(mode):
    model = Custom(_inplace_relu_on_overlapping_pieces)
    model.gate_up_proj = nn.Linear(D, 2 * F_)
    with torch.no_grad():
        gm, inputs = capture(mode, model, torch.randn(4, 3, D))
        assert_left_alone(rewrite(gm, inputs, rewritten=0), "overlaps the up projection's piece", kind="gated")
        model.fn = _inplace_relu_on_disjoint_pieces
        gm, inputs = capture(mode, model, torch.randn(4, 3, D))
        rewrite(gm, inputs, rewritten=1)


def test_uneven_chunk_reported():
    # 2F + 2 features chunk into F + 1 and F + 1 here, then the down projection takes F + 1 features:
    # fine. With 2F + 1 the pieces are F + 1 and F, whose product would broadcast or fail.
    gm, inputs = capture("symbolic", FusedGateUpMLP(out_features=2 * F_ + 1), x3d())
    with pytest.raises(RuntimeError):
        gm(*inputs)
    report = run_passes(gm)
    assert_left_alone(report, f"gate weight [{F_ + 1}, {D}] and up weight [{F_}, {D}] differ")


# ---------------------------------------------------------------------------------------------------
# Dropouts that return their input (eval mode, p = 0) are looked through (T5: wo(dropout(relu(wi(x)))))
# ---------------------------------------------------------------------------------------------------

IDENTITY_DROPOUTS = {
    "F.dropout(training=False)": lambda t: F.dropout(t, 0.1, training=False),
    "F.dropout(p=0)": lambda t: F.dropout(t, p=0.0),
    "torch.dropout(train=False)": lambda t: torch.dropout(t, 0.3, False),
}


class DropoutMLP(nn.Module):
    """A gated block with a dropout on the gate, after the ReLU and after the product, as T5 and
    others place them; ``nn.Dropout`` modules unless ``dropout`` names a functional spelling."""

    def __init__(self, dropout: str | None = None, p: float = 0.1):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, F_), nn.Linear(D, F_)
        self.down_proj = nn.Linear(F_, D_OUT)
        self.drop = IDENTITY_DROPOUTS[dropout] if dropout else nn.Dropout(p)

    def forward(self, x):
        gate = torch.relu(self.drop(self.gate_proj(x)))
        return self.down_proj(self.drop(self.drop(gate) * self.up_proj(x)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dropout", list(IDENTITY_DROPOUTS))
def test_identity_dropouts_looked_through(mode, dropout):
    gm, inputs = capture(mode, Wrapped(DropoutMLP(dropout)), x3d())
    rewrite(gm, inputs, rewritten=1, left_alone=0)
    assert not [n for n in gm.graph.nodes if "dropout" in str(n.target)], gm.code


@pytest.mark.parametrize("mode", ["dynamo", "export"])
def test_eval_mode_dropout_modules_looked_through(mode):
    # Dynamo and export bake the eval-mode flag into the graph as a literal (and guard on it).
    gm, inputs = capture(mode, Wrapped(DropoutMLP()), x3d())
    rewrite(gm, inputs, rewritten=1, left_alone=0)


def test_training_mode_dropout_left_alone():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Custom(_dropout_before_down).train(), backend=record, fullgraph=True)(x3d())
    report = run_passes(graphs[0])
    assert_left_alone(report, "dropout", "sits between the relu and the down projection")
    # The same model in eval mode: the dropout is an identity, and the block is rewritten.
    gm, inputs = capture("dynamo", Custom(_dropout_before_down), x3d())
    rewrite(gm, inputs, rewritten=1, left_alone=0)


def test_dropout_module_of_symbolic_trace_left_alone():
    # The traced module may be put back in training mode later: its Dropout is not an identity.
    gm, inputs = capture("symbolic", Wrapped(DropoutMLP()), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert report.left_alone_count == 0, str(report)  # three dropouts: no near-miss shape either
    gm, inputs = capture("symbolic", Custom(_dropout_before_down), x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0), "Dropout (dropout) sits between")


# ---------------------------------------------------------------------------------------------------
# Near-misses that must be left alone, with a reason
# ---------------------------------------------------------------------------------------------------


def _relu_output_reused(m, x):
    hidden = torch.relu(m.gate_proj(x))
    return m.down_proj(hidden * m.up_proj(x)) + hidden.sum()


def _product_reused(m, x):
    product = torch.relu(m.gate_proj(x)) * m.up_proj(x)
    return m.down_proj(product), product


def _gate_output_reused(m, x):
    gate = m.gate_proj(x)
    return m.down_proj(torch.relu(gate) * m.up_proj(x)) + gate.mean()


def _up_output_reused(m, x):
    up = m.up_proj(x)
    return m.down_proj(torch.relu(m.gate_proj(x)) * up) + up.mean()


def _different_inputs(m, x):
    return m.down_proj(torch.relu(m.gate_proj(x)) * m.up_proj(x * 2))


def _relu_after_mul(m, x):
    return m.down_proj(torch.relu(m.gate_proj(x) * m.up_proj(x)))


def _dropout_between(m, x):
    return m.down_proj(m.dropout(torch.relu(m.gate_proj(x))) * m.up_proj(x))


def _scale_between(m, x):
    return m.down_proj(torch.relu(m.gate_proj(x)) * 0.5 * m.up_proj(x))


def _op_before_down(m, x):
    return m.down_proj(torch.relu(m.gate_proj(x)) * m.up_proj(x) + 1.0)


def _dropout_before_down(m, x):
    return m.down_proj(m.dropout(torch.relu(m.up_proj(x))))


def _both_factors_activated(m, x):  # dReLU
    return m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x)))


def _down_elsewhere(m, x):
    product = torch.relu(m.gate_proj(x)) * m.up_proj(x)
    return m.down_proj(torch.zeros_like(product)) + product.sum()


NEAR_MISSES = {
    "relu_output_reused": (_relu_output_reused, "the relu output (relu) has another user"),
    "product_reused": (_product_reused, "the product relu(gate) * up (mul) has another user"),
    "gate_output_reused": (_gate_output_reused, "the gate projection output (gate_proj) has another user"),
    "up_output_reused": (_up_output_reused, "the up projection output (up_proj) has another user"),
    "different_inputs": (_different_inputs, "gate and up read different inputs"),
    "relu_after_mul": (_relu_after_mul, "relu is applied to the product"),
    "dropout_between": (_dropout_between, "Dropout (dropout) sits between the relu and the product"),
    "scale_between": (_scale_between, "operator.mul (mul) sits between the relu and the product"),
    "op_before_down": (_op_before_down, "sits between the product and the down projection"),
    "dropout_before_down": (_dropout_before_down, "sits between the relu and the down projection"),
    "down_elsewhere": (_down_elsewhere, None),
    "both_factors_activated": (_both_factors_activated,
                               "both factors of the product are activated (relu(gate(x)) * relu(up(x)))"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_left_alone(name):
    fn, reason = NEAR_MISSES[name]
    gm, inputs = capture("symbolic", Custom(fn), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    if reason is not None:
        assert_left_alone(report, reason)


@pytest.mark.parametrize("name", ["relu_output_reused", "different_inputs", "scale_between", "relu_after_mul",
                                  "both_factors_activated"])
def test_near_miss_left_alone_dynamo(name):
    fn, _ = NEAR_MISSES[name]
    gm, inputs = capture("dynamo", Custom(fn), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert report.left_alone_count == 1, str(report)


@pytest.mark.parametrize("act", ["silu", "gelu", "sigmoid"])
@pytest.mark.parametrize("mode", ["symbolic", "export", "export_decomposed"])
def test_other_activations_reported(act, mode):
    gm, inputs = capture(mode, Wrapped(GatedMLP(act=act)), x3d())
    report = rewrite(gm, inputs, rewritten=0, left_alone=1)
    assert_left_alone(report, f"activation is {act}, not relu", kind="gated")
    gm, inputs = capture(mode, NonGatedMLP(act="gelu"), x3d())
    report = rewrite(gm, inputs, rewritten=0, left_alone=1)
    assert_left_alone(report, "activation is gelu, not relu", kind="non_gated")


def test_broadcasting_weight_shapes():
    # up projects to 1 feature: relu(gate) * up broadcasts, which the fused op cannot express.
    gm, inputs = capture("symbolic", GatedMLP(up_out=1), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert_left_alone(report, "gate weight [16, 8] and up weight [1, 8] differ")


def test_shapes_unknown_without_metadata():
    def mlp(x, wg, wu, wd):
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    args = (x3d(), torch.randn(F_, D), torch.randn(F_, D), torch.randn(D_OUT, F_))
    gm = fx.symbolic_trace(mlp)
    report = rewrite(gm, args, rewritten=0)
    assert_left_alone(report, "shapes unknown")
    # With shape metadata the same graph is rewritten.
    gm = fx.symbolic_trace(mlp)
    ShapeProp(gm).propagate(*args)
    rewrite(gm, args, rewritten=1)


def test_mismatched_weight_shapes_from_metadata():
    def mlp(x, wg, wu, wd):
        return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    x = torch.randn(2, 3, D)
    # [16, 8] gate with a [1, 8] up: broadcasting product.
    args = (x, torch.randn(F_, D), torch.randn(1, D), torch.randn(D_OUT, F_))
    gm = fx.symbolic_trace(mlp)
    ShapeProp(gm).propagate(*args)
    assert_left_alone(rewrite(gm, args, rewritten=0), "differ")


def test_in_place_op_inside_block():
    def mutate_between(m, x):
        x = x.clone()
        gate = m.gate_proj(x)
        x.mul_(2)  # up reads the doubled x: one fused call could not see both values
        return m.down_proj(torch.relu(gate) * m.up_proj(x))

    gm, inputs = capture("symbolic", Custom(mutate_between), x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert_left_alone(report, "may modify its inputs")


def test_options_disable_each_kind():
    options = types.SimpleNamespace(gated=False, non_gated=True, debug=True)
    gm, inputs = capture("symbolic", Wrapped(GatedMLP()), x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0, options=options), "options.gated=False")
    gm, inputs = capture("symbolic", Wrapped(NonGatedMLP()), x3d())
    rewrite(gm, inputs, rewritten=1, options=options)
    options = types.SimpleNamespace(gated=True, non_gated=False, debug=False)
    gm, inputs = capture("symbolic", Wrapped(NonGatedMLP()), x3d())
    assert_left_alone(rewrite(gm, inputs, rewritten=0, options=options), "options.non_gated=False")


def test_twell_options_object():
    from twell_compile.options import TwellOptions

    gm, inputs = capture("symbolic", Wrapped(GatedMLP()), x3d())
    rewrite(gm, inputs, rewritten=0, options=TwellOptions(gated=False))


# ---------------------------------------------------------------------------------------------------
# Metadata, cleanup, counters, pass manager
# ---------------------------------------------------------------------------------------------------


def test_dynamo_meta_and_dead_nodes():
    gm, inputs = capture("dynamo", Wrapped(GatedMLP(bias=(True, True, True))), x3d())
    down = next(n for n in gm.graph.nodes if n.name == "linear_2")
    down_value = down.meta["example_value"]
    rewrite(gm, inputs, rewritten=1)
    (call,) = twell_calls(gm)
    assert call.meta["example_value"] is down_value
    assert "source_fn_stack" not in call.meta
    assert [clean_module_path(p) for p, _ in call.meta["nn_module_stack"].values()] == ["mlp"]
    assert call.meta["stack_trace"] == down.meta["stack_trace"]
    remaining = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert F.relu not in remaining and operator.mul not in remaining


def test_export_decomposed_cleanup_keeps_unrelated_nodes():
    gm, inputs = capture("export_decomposed", Wrapped(GatedMLP()), x3d())
    rewrite(gm, inputs, rewritten=1)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(aten.addmm.default) == 1  # the residual projection's own addmm stays
    assert aten.mm.default not in targets and aten.relu.default not in targets
    assert aten.sym_size.int not in targets
    assert "_guards_fn" in targets  # export's guard call has no users and must survive
    (call,) = twell_calls(gm)
    assert tuple(node_tensor_meta(call).shape) == (2, 3, D_OUT)


def test_counters():
    counters.clear()
    for mlp in (GatedMLP(), NonGatedMLP(), GatedMLP(act="silu")):
        run_passes(fx.symbolic_trace(Wrapped(mlp)), None)
    assert dict(counters["twell"]) == {"gated_relu_mlp": 1, "relu_mlp": 1, "left_alone": 1}


def test_pass_manager_times_and_reports():
    manager = TwellPassManager(types.SimpleNamespace(gated=True, non_gated=True, debug=True))
    assert [p.name for p in manager.passes] == ["relu_mlp_fusion"]
    report = manager(fx.symbolic_trace(Wrapped(GatedMLP())))
    assert report.rewritten_count == 1
    assert set(report.pass_times_s) == {"relu_mlp_fusion"} and report.elapsed_s > 0
    text = str(report)
    for part in ("1 rewritten (1 gated, 0 non-gated)", "mlp [gated] REWRITTEN", "before:", "after:",
                 "torch.ops.twell.gated_relu_mlp.default(x, ", "per layer:", "passes: relu_mlp_fusion"):
        assert part in text, text


def test_pass_is_usable_alone():
    gm, inputs = capture("symbolic", Wrapped(NonGatedMLP()), x3d())
    expected = outputs(gm, inputs)
    candidates = ReluMlpFusionPass()(gm)
    assert [c.status for c in candidates] == ["rewritten"]
    torch.testing.assert_close(outputs(gm, inputs), expected)


def test_no_candidates_leaves_graph_untouched():
    model = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D))
    gm, inputs = capture("symbolic", model, x3d())
    code = gm.code
    report = rewrite(gm, inputs, rewritten=0, left_alone=0)
    assert gm.code == code
    assert "0 candidate block(s)" in str(report)


# ---------------------------------------------------------------------------------------------------
# Golden printouts
# ---------------------------------------------------------------------------------------------------


class TestGolden(expecttest.TestCase):
    def test_rewritten_code(self):
        gm, inputs = capture("symbolic", Wrapped(GatedMLP(bias=(True, False, True))), x3d())
        rewrite(gm, inputs, rewritten=1)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x):
    mlp_gate_proj_weight = self.mlp.gate_proj.weight
    mlp_up_proj_weight = self.mlp.up_proj.weight
    mlp_down_proj_weight = self.mlp.down_proj.weight
    mlp_gate_proj_bias = self.mlp.gate_proj.bias
    mlp_down_proj_bias = self.mlp.down_proj.bias
    gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(x, mlp_gate_proj_weight, mlp_up_proj_weight, mlp_down_proj_weight, mlp_gate_proj_bias, None, mlp_down_proj_bias);  mlp_gate_proj_weight = mlp_up_proj_weight = mlp_down_proj_weight = mlp_gate_proj_bias = mlp_down_proj_bias = None
    proj = self.proj(gated_relu_mlp);  gated_relu_mlp = None
    add = x + proj;  x = proj = None
    return add""")

    def test_candidate_printout(self):
        gm, inputs = capture("symbolic", Wrapped(NonGatedMLP(act="torch.relu")), x3d())
        report = rewrite(gm, inputs, rewritten=1)
        self.assertExpectedInline(str(report.candidates[0]), """\
mlp [non_gated] REWRITTEN: down(relu(up(x))) with x = x (nn.Linear)
  before:
    mlp_up_proj = self.mlp.up_proj(x)
    relu = torch.relu(mlp_up_proj)
    mlp_down_proj = self.mlp.down_proj(relu)
  after:
    mlp_up_proj_weight = self.mlp.up_proj.weight
    mlp_down_proj_weight = self.mlp.down_proj.weight
    relu_mlp = torch.ops.twell.relu_mlp.default(x, mlp_up_proj_weight, mlp_down_proj_weight, None, None)""")

    def test_fused_gate_up_printout(self):
        gm, inputs = capture("symbolic", Wrapped(FusedGateUpMLP(gate_second=True)), x3d())
        report = rewrite(gm, inputs, rewritten=1)
        self.assertExpectedInline(str(report.candidates[0]), """\
mlp [gated] REWRITTEN: down(relu(gate(x)) * up(x)) with x = x (chunk piece of nn.Linear, nn.Linear)
  before:
    mlp_gate_up_proj = self.mlp.gate_up_proj(x)
    chunk = mlp_gate_up_proj.chunk(2, dim=-1)
    getitem = operator.getitem(chunk, 0)
    getitem_1 = operator.getitem(chunk, 1)
    relu = torch.relu(getitem_1)
    mul = operator.mul(getitem, relu)
    mlp_down_proj = self.mlp.down_proj(mul)
  after:
    mlp_gate_up_proj_weight = self.mlp.gate_up_proj.weight
    slice_tensor = torch.ops.aten.slice.Tensor(mlp_gate_up_proj_weight, 0, 16, 32)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(mlp_gate_up_proj_weight, 0, 0, 16)
    mlp_down_proj_weight = self.mlp.down_proj.weight
    mlp_gate_up_proj_bias = self.mlp.gate_up_proj.bias
    slice_tensor_2 = torch.ops.aten.slice.Tensor(mlp_gate_up_proj_bias, 0, 16, 32)
    slice_tensor_3 = torch.ops.aten.slice.Tensor(mlp_gate_up_proj_bias, 0, 0, 16)
    mlp_down_proj_bias = self.mlp.down_proj.bias
    gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(x, slice_tensor, slice_tensor_1, mlp_down_proj_weight, slice_tensor_2, slice_tensor_3, mlp_down_proj_bias)""")

    def test_near_miss_printout(self):
        gm, inputs = capture("export_decomposed", Wrapped(Custom(_relu_after_mul)), torch.randn(4, D))
        report = rewrite(gm, inputs, rewritten=0)
        self.assertExpectedInline(str(report.candidates[0]), """\
mlp [gated] LEFT ALONE: relu is applied to the product (down(relu(gate(x) * up(x)))), not to the gate
  before:
    permute = torch.ops.aten.permute.default(mlp_gate_proj_weight, [1, 0])
    addmm = torch.ops.aten.addmm.default(mlp_gate_proj_bias, x, permute)
    permute_1 = torch.ops.aten.permute.default(mlp_up_proj_weight, [1, 0])
    addmm_1 = torch.ops.aten.addmm.default(mlp_up_proj_bias, x, permute_1)
    mul = torch.ops.aten.mul.Tensor(addmm, addmm_1)
    relu = torch.ops.aten.relu.default(mul)
    permute_2 = torch.ops.aten.permute.default(mlp_down_proj_weight, [1, 0])
    addmm_2 = torch.ops.aten.addmm.default(mlp_down_proj_bias, relu, permute_2)""")


# ---------------------------------------------------------------------------------------------------
# Modules whose call does more than their forward: hooks (call_module nodes of symbolic_trace graphs)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "global_forward"])
def test_hooked_linears_are_not_read_as_plain_linears(hook):
    model = GatedMLP()
    if hook == "forward":
        handle = model.gate_proj.register_forward_hook(lambda module, args, out: out * 2 - 1)
    elif hook == "forward_pre":
        handle = model.gate_proj.register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        gm, inputs = capture("symbolic", model, x3d())
        report = rewrite(gm, inputs, rewritten=0)
        assert report.left_alone_count == 0, str(report)  # no linear seen, so no block either
    finally:
        handle.remove()


def test_a_view_as_another_dtype_is_not_a_reshape():
    """``t.view(torch.int32)`` reinterprets the bits: a block around it is no ReLU MLP."""
    def integer_product(m, x):  # the product of the bits as integers, read back as floats
        h = torch.relu(m.gate_proj(x)).view(torch.int32) * m.up_proj(x).view(torch.int32)
        return m.down_proj(h.view(torch.float32))

    for mode in ("symbolic", "dynamo"):
        gm, inputs = capture(mode, Custom(integer_product), x3d())
        rewrite(gm, inputs, rewritten=0)


def test_dtypes_the_ops_do_not_take_are_left_alone():
    """An integer MLP computes in eager; the op would refuse it, so the block is left alone."""
    from twell_compile.passes.relu_mlp_fusion import OP_DTYPES
    from twell_compile.validation import SUPPORTED_DTYPES

    assert set(OP_DTYPES) == set(SUPPORTED_DTYPES)

    def integer_mlp(x, gate, up, down):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, gate)) *
                                          torch.nn.functional.linear(x, up), down)

    args = [torch.randint(-3, 3, shape) for shape in [(3, D), (F_, D), (F_, D), (D_OUT, F_)]]
    gm, inputs = capture("dynamo", Custom(lambda m, x: integer_mlp(x, *args[1:])), args[0])
    assert_left_alone(rewrite(gm, inputs, rewritten=0), "has dtype torch.int64, which the twell ops do not take")


# ---------------------------------------------------------------------------------------------------
# Semantics kept where the graph does something unusual (a review's cases, 2026-11-30)
# ---------------------------------------------------------------------------------------------------


def test_private_in_place_functions_inside_a_block_are_mutations():
    """``torch._foreach_add_`` (like ``_fused_adam_``) writes into its arguments: between the gate and
    the up projection it changes what up reads, so the block stays."""
    def foreach_between(m, x):
        gate = torch.relu(m.gate_proj(x))
        torch._foreach_add_([x], 1.0)
        return m.down_proj(gate * m.up_proj(x))

    for mode in ("symbolic", "dynamo"):
        gm, _ = capture(mode, Custom(foreach_between), x3d())
        report = run_passes(gm)
        assert report.rewritten_count == 0, str(report)
        assert "may modify its inputs" in " | ".join(report.reasons)


class _PiecesReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(D, 2 * F_)
        self.down_proj = nn.Linear(F_, D_OUT)

    def forward(self, x):
        pieces = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.relu(pieces[0], inplace=True) * pieces[1]), pieces


class _PiecesCatInto(_PiecesReturned):
    def forward(self, x, buf):
        pieces = self.gate_up_proj(x).chunk(2, -1)
        torch.cat(pieces, -1, out=buf)
        return self.down_proj(F.relu(pieces[0]) * pieces[1])


def test_only_indexed_pieces_of_a_split_go_with_the_block():
    """A split's reader that has no users of its own is the block's only when it takes a piece by
    indexing (symbolic_trace keeps ``_`` of ``gate, _ = t.chunk(2, -1)``): the graph's output returning
    the pieces, or ``torch.cat(pieces, out=...)``, must stay."""
    model, x = _PiecesReturned().requires_grad_(False), x3d()
    expected = model(x)
    gm = fx.symbolic_trace(model)
    run_passes(gm)
    torch.testing.assert_close(gm(x), expected)  # the pieces too: the gate's as the in-place relu left it

    model = _PiecesCatInto().requires_grad_(False)
    buf, want = torch.zeros(*x.shape[:-1], 2 * F_), torch.zeros(*x.shape[:-1], 2 * F_)
    model(x, want)
    gm = fx.symbolic_trace(model)
    run_passes(gm)
    gm(x, buf)
    torch.testing.assert_close(buf, want)  # the cat still wrote its output


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
def test_a_private_value_read_by_a_weight_transpose_is_an_escape(mode):
    """``a = relu_(h); a @ h.T``: the down weight is ``h`` itself, which the in-place relu changed. Its
    transpose is a shared node that stays in the graph, so ``h`` escapes the block."""
    def weight_from_hidden(m, x):
        h = m.up_proj(x)
        a = torch.relu_(h)
        return a @ h.T

    gm, inputs = capture(mode, Custom(weight_from_hidden), torch.randn(5, D))
    report = rewrite(gm, inputs, rewritten=0)
    assert report.left_alone_count == 0 or "has another user" in " | ".join(report.reasons)


@pytest.mark.parametrize("mode", ["symbolic", "dynamo"])
def test_an_in_place_relu_of_a_value_that_is_also_up_is_left_alone(mode):
    """``relu_(h) * h`` multiplies relu(h) by relu(h) in eager (the in-place relu changed h); the fused op
    would compute relu(h) * h (they differ where h is -inf)."""
    def same_value(m, x):
        h = m.up_proj(x)
        return m.down_proj(torch.relu_(h) * h)

    model = Custom(same_value).requires_grad_(False)
    gm, inputs = capture(mode, model, x3d())
    report = rewrite(gm, inputs, rewritten=0)
    assert "gate and up are one value" in " | ".join(report.reasons), str(report)


def test_clamp_follows_the_grad_mode_the_dynamo_graph_records():
    """A Dynamo graph records each value's requires_grad as traced, grad mode switched inside it
    included: compiled under no_grad with ``torch.enable_grad()`` around the block, the clamp stays."""
    def grad_inside(m, x):
        with torch.enable_grad():
            return m.down_proj(m.gate_proj(x).clamp(min=0) * m.up_proj(x))

    with torch.no_grad():
        gm, inputs = capture("dynamo", Custom(grad_inside), x3d())
        assert_left_alone(rewrite(gm, inputs, rewritten=0), "relu spelled as a clamp")
        gm, inputs = capture("dynamo", Custom(lambda m, x: m.down_proj(m.gate_proj(x).clamp(min=0) * m.up_proj(x))),
                             x3d())
        rewrite(gm, inputs, rewritten=1)


@pytest.mark.parametrize("transform", ["grad", "jvp", "forward_ad"])
def test_blocks_inside_autodiff_transforms_are_left_alone(transform):
    """The twell ops' autograd is reverse mode only, without functorch support: a block inside
    torch.func.grad or jvp, or a forward-mode AD level, stays, so such a model compiles and runs."""
    import torch.autograd.forward_ad as fwAD

    def forward(m, x):
        block = lambda t: m.down_proj(torch.relu(m.gate_proj(t)) * m.up_proj(t))  # noqa: E731
        if transform == "grad":
            return torch.func.grad(lambda t: block(t).sum())(x)
        if transform == "jvp":
            return torch.func.jvp(block, (x,), (torch.ones_like(x),))[1]
        with fwAD.dual_level():
            return fwAD.unpack_dual(block(fwAD.make_dual(x, torch.ones_like(x)))).tangent

    with torch.no_grad():
        gm, inputs = capture("dynamo", Custom(forward), x3d())
        assert_left_alone(rewrite(gm, inputs, rewritten=0), "torch.func grad or jvp transform")
