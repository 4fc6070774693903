"""The public API besides the backend: ``rewrite``, ``explain`` and ``to_networkx``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import twell_compile
from helpers import (
    GatedMLP,
    ReluMLP,
    SiluGatedMLP,
    Stack,
    WithGraphBreakModel,
    capture_dynamo_graphs,
    twell_targets,
)
from twell_compile.graph_export import to_networkx

HIDDEN, INTER = 16, 32


def _x(*leading):
    return torch.randn(*leading, HIDDEN)


def _call_targets(gm: fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")}


# ---------------------------------------------------------------------------------------------------
# rewrite
# ---------------------------------------------------------------------------------------------------


def test_rewrite_graph_module_leaves_original_untouched_and_shares_parameters():
    model = Stack([GatedMLP(HIDDEN, INTER, bias=True), ReluMLP(HIDDEN, INTER)], HIDDEN)
    traced = fx.symbolic_trace(model)
    code_before = traced.code
    nodes_before = len(traced.graph.nodes)
    x = _x(2, 5)

    rewritten, report = twell_compile.rewrite(traced, x)

    assert (report.gated_count, report.non_gated_count, report.left_alone_count) == (1, 1, 0)
    assert twell_targets(rewritten) == ["twell.gated_relu_mlp.default", "twell.relu_mlp.default"]
    # The traced module is as it was ...
    assert traced.code == code_before and len(traced.graph.nodes) == nodes_before
    assert twell_targets(traced) == []
    assert rewritten is not traced and rewritten.graph is not traced.graph
    # ... and both use the very same parameter tensors (no copies).
    original_params = dict(traced.named_parameters())
    for name, param in rewritten.named_parameters():
        assert param is original_params[name], name
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(2.0)  # visible through both modules
        assert torch.equal(rewritten(x), model(x))
        assert torch.equal(traced(x), model(x))


def test_rewrite_dynamo_graph():
    model = GatedMLP(HIDDEN, INTER)
    x = _x(2, 5)
    (gm,) = capture_dynamo_graphs(model, x)
    rewritten, report = twell_compile.rewrite(gm)
    assert report.rewritten_count == 1
    assert twell_targets(rewritten) == ["twell.gated_relu_mlp.default"]
    assert twell_targets(gm) == []
    # Dynamo lifted the weights to inputs: the rewritten graph takes the same arguments, and no
    # linear, relu or mul of the block is left.
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.target for n in rewritten.graph.nodes if n.op == "placeholder"] == placeholders
    assert not {"torch._C._nn.linear", "torch.nn.functional.relu", "<built-in function mul>"} & {
        str(t) for t in _call_targets(rewritten)
    }


def test_rewrite_exported_program():
    model = Stack([GatedMLP(HIDDEN, INTER, bias=True), ReluMLP(HIDDEN, INTER)], HIDDEN).eval()
    x = _x(2, 5)
    dynamic = torch.export.Dim.DYNAMIC
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: dynamic, 1: dynamic}})
    ep_code = ep.graph_module.code

    rewritten, report = twell_compile.rewrite(ep)

    assert (report.gated_count, report.non_gated_count, report.left_alone_count) == (1, 1, 0)
    assert twell_targets(rewritten) == ["twell.gated_relu_mlp.default", "twell.relu_mlp.default"]
    assert ep.graph_module.code == ep_code  # the exported program is not changed
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x), rtol=0, atol=0)
        x2 = _x(4, 3)
        torch.testing.assert_close(rewritten(x2), model(x2), rtol=0, atol=0)


def test_rewrite_nn_module_with_and_without_example_inputs():
    model = Stack([GatedMLP(HIDDEN, INTER), GatedMLP(HIDDEN, INTER)], HIDDEN)
    x = _x(3, 4)
    for args in [(), (x,)]:
        rewritten, report = twell_compile.rewrite(model, *args)
        # The nn.Linear modules carry their weight shapes, so no example input is needed here.
        assert report.gated_count == 2, args
        assert twell_targets(rewritten) == ["twell.gated_relu_mlp.default"] * 2
        with torch.no_grad():
            assert torch.equal(rewritten(x), model(x))
    assert not any(isinstance(m, fx.GraphModule) for m in model.modules())  # model itself unchanged


def functional_gated_mlp(x, gate_w, up_w, down_w):
    return F.linear(F.relu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def test_rewrite_needs_shapes_when_weights_are_inputs():
    # Weights passed as graph inputs: without example inputs nothing proves their shapes agree, so
    # the block is left alone and the report says why; with example inputs it is rewritten.
    traced = fx.symbolic_trace(functional_gated_mlp)
    args = (_x(2, 3), torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER))

    unshaped, report = twell_compile.rewrite(traced)
    assert report.rewritten_count == 0 and report.left_alone_count == 1
    assert report.reasons[0].startswith("shapes unknown") and "gate_w" in report.reasons[0]
    assert twell_targets(unshaped) == []

    shaped, report = twell_compile.rewrite(traced, *args)
    assert report.rewritten_count == 1
    assert twell_targets(shaped) == ["twell.gated_relu_mlp.default"]
    assert torch.equal(shaped(*args), functional_gated_mlp(*args))


def test_rewrite_options():
    model = Stack([GatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN)
    _, report = twell_compile.rewrite(model, options={"gated": False})
    assert (report.gated_count, report.non_gated_count) == (0, 1)
    _, report = twell_compile.rewrite(model, options={"non_gated": False})
    assert (report.gated_count, report.non_gated_count) == (1, 0)
    with pytest.raises(ValueError, match=r"unknown option 'nongated'\. Did you mean 'non_gated'"):
        twell_compile.rewrite(model, options={"nongated": False})
    with pytest.raises(ValueError, match=r"Inductor options \['max_autotune'\] only apply to torch.compile"):
        twell_compile.rewrite(model, options={"max_autotune": True})


def test_rewrite_rejects_other_objects():
    with pytest.raises(TypeError, match=r"expected an fx.GraphModule, a torch.export.ExportedProgram or an nn.Module, got function"):
        twell_compile.rewrite(functional_gated_mlp)


def test_rewrite_leaves_the_original_higher_order_bodies_untouched():
    """A checkpoint region's body is a GraphModule the passes rewrite in place: the copy rewrite makes
    gets its own, and the original keeps its linears and relu."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = ReluMLP(HIDDEN, INTER)

        def forward(self, x):
            return checkpoint(self.mlp, x, use_reentrant=False)

    graphs = capture_dynamo_graphs(Checkpointed(), _x(2))
    (gm,) = graphs

    def body_targets(g):
        bodies = [getattr(g, n.target) for n in g.graph.nodes if n.op == "get_attr"]
        return [str(n.target) for b in bodies for n in b.graph.nodes if n.op == "call_function"]

    before = body_targets(gm)
    rewritten, report = twell_compile.rewrite(gm)
    assert report.rewritten_count == 1
    assert body_targets(gm) == before and "twell" not in " ".join(before)
    assert any("twell" in t for t in body_targets(rewritten))


# ---------------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------------


def test_explain_prints_every_candidate(capsys):
    model = Stack([GatedMLP(HIDDEN, INTER), SiluGatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN)
    x = _x(2, 5)
    weights_before = {k: v.clone() for k, v in model.state_dict().items()}

    result = twell_compile.explain(model, x)
    printed = capsys.readouterr().out

    assert (result.rewritten, result.left_alone, result.graph_break_count) == (2, 1, 0)
    assert printed.strip() == str(result).strip()
    assert "1 graph(s), 0 graph break(s); 2 block(s) rewritten, 1 left alone" in printed
    # every candidate, with its module, status and reason
    assert "layers.0.mlp [gated] REWRITTEN" in printed
    assert "layers.1.mlp [gated] LEFT ALONE" in printed and "silu" in printed.lower()
    assert "layers.2.mlp [non_gated] REWRITTEN" in printed
    # before/after code of each rewritten block
    assert printed.count("before:") == 3 and printed.count("after:") == 2
    assert "torch.ops.twell.gated_relu_mlp" in printed and "torch.ops.twell.relu_mlp" in printed
    # per-layer counts
    assert "layers.0: 1 rewritten, 0 left alone" in printed
    assert "layers.1: 0 rewritten, 1 left alone" in printed
    assert "layers.2: 1 rewritten, 0 left alone" in printed
    # the model is not changed and nothing was compiled into it
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights_before.items())
    assert not any(isinstance(m, fx.GraphModule) for m in model.modules())


def test_explain_counts_graph_breaks_and_can_stay_quiet(capsys):
    result = twell_compile.explain(WithGraphBreakModel(HIDDEN, INTER), _x(3), print_report=False)
    assert capsys.readouterr().out == ""
    assert result.graph_break_count == 1
    assert len(result.graph_reports) == 2
    assert [r.rewritten_count for r in result.graph_reports] == [1, 1]


class _LayerBreakingInside(torch.nn.Module):
    """A layer with a graph break before its MLP: Dynamo compiles the layer's own frame."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.mlp = GatedMLP(HIDDEN, INTER)

    def forward(self, x):
        x = self.norm(x)
        torch._dynamo.graph_break()
        return x + self.mlp(x)


class _Layers(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(_LayerBreakingInside() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_explain_names_the_modules_a_layer_frame_ran_for():
    """One graph of a layer's frame serves every layer: its block is named relative to the frame, under
    a title listing the layers whose parameters its calls were passed."""
    result = twell_compile.explain(_Layers(3), _x(2), print_report=False)
    [report] = [r for r in result.graph_reports if r.rewritten_count]
    assert [c.module_path for c in report.candidates] == ["mlp"]
    assert report.graph_name == ("one frame, run for 3 modules: layers.0, layers.1, layers.2 "
                                 "(block paths are relative to each)")
    assert "twell rewrite report for one frame, run for 3 modules" in str(result)


def test_explain_gives_full_paths_where_a_layer_frame_ran_once():
    result = twell_compile.explain(_Layers(1), _x(2), print_report=False)
    [report] = [r for r in result.graph_reports if r.rewritten_count]
    assert [c.module_path for c in report.candidates] == ["layers.0.mlp"]
    assert report.graph_name == "the frame of layers.0"
    # Graphs of the model's own frame keep their names as they are.
    whole = twell_compile.explain(Stack([GatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN), _x(2),
                                  print_report=False)
    assert [[c.module_path for c in r.candidates] for r in whole.graph_reports] == [["layers.0.mlp", "layers.1.mlp"]]
    assert "frame" not in whole.graph_reports[0].graph_name


def test_explain_says_when_dynamo_reached_its_recompile_limit():
    """Layers that each make Dynamo recompile their frame (a guard on a string attribute here; a Hugging
    Face KV cache's per-layer state does the same) run eagerly past the recompile limit: explain says so."""
    model = _Layers(4)
    for i, layer in enumerate(model.layers):
        layer.tag = f"layer {i}"
    layer_forward = _LayerBreakingInside.forward

    def tagged_forward(self, x):
        return layer_forward(self, x) * (2.0 if self.tag.endswith("0") else 1.0)

    plain = twell_compile.explain(_Layers(3), _x(2), print_report=False)
    assert not plain.recompile_limit_hit and "recompile limit" not in str(plain)
    with torch._dynamo.config.patch(recompile_limit=2), pytest.MonkeyPatch.context() as patch:
        patch.setattr(_LayerBreakingInside, "forward", tagged_forward)
        result = twell_compile.explain(model, _x(2), print_report=False)
    assert result.recompile_limit_hit
    assert "note: Dynamo reached its recompile limit on this run" in str(result)


def test_frame_module_needs_its_inputs_to_agree():
    from twell_compile.frame_names import frame_module

    a, b, c, tied = (torch.zeros(1) for _ in range(4))
    names = {id(a): ["m.layers.0.mlp.w"], id(b): ["m.layers.1.mlp.v"], id(c): ["mlp.w"],
             id(tied): ["m.layers.0.mlp.v", "m.layers.1.mlp.v"]}
    inputs = [(0, "mlp.w"), (1, "mlp.v")]
    assert frame_module((a, a), [(0, "mlp.w")], names) == "m.layers.0"
    assert frame_module((a, b), inputs, names) is None  # two layers' parameters: no single frame
    assert frame_module((a, tied), inputs, names) == "m.layers.0"  # a tied weight allows both layers
    assert frame_module((tied,), [(0, "mlp.v")], names) is None  # ... and alone tells neither
    assert frame_module((c,), [(0, "mlp.w")], names) == ""  # the model's own frame
    assert frame_module((torch.zeros(1),), [(0, "mlp.w")], names) is None  # not the model's


def test_explain_names_layers_that_share_a_tied_weight():
    model = _Layers(2)
    model.layers[1].mlp.up_proj.weight = model.layers[0].mlp.up_proj.weight
    result = twell_compile.explain(model, _x(2), print_report=False)
    [report] = [r for r in result.graph_reports if r.rewritten_count]
    assert report.graph_name.startswith("one frame, run for 2 modules: layers.0, layers.1 ")


def test_name_blocks_keeps_what_it_cannot_place():
    from twell_compile.frame_names import UNKNOWN, name_blocks
    from twell_compile.passes.report import CandidateBlock, RewriteReport

    def report(path):
        return RewriteReport([CandidateBlock("gated", "rewritten", "", path, "")], graph_name="GraphModule")

    model = _Layers(2)
    one = report("nodes linear..down")  # a block at the frame's own level has no module path
    name_blocks(one, ["layers.1"], model)
    assert one.candidates[0].module_path == "layers.1 (nodes linear..down)"
    partly = report("mlp")  # one call named its module, another did not: no full path is given
    name_blocks(partly, ["layers.1", UNKNOWN], model)
    assert partly.candidates[0].module_path == "mlp"
    assert partly.graph_name == ("one frame, run for 1 module: layers.1 and calls of a module its inputs do "
                                 "not name (block paths are relative to each)")
    mixed = report("mlp")
    name_blocks(mixed, ["", "layers.1"], model)
    assert mixed.graph_name.startswith("one frame, run for 2 modules: <model>, layers.1 ")
    root = report("layers.0.mlp")
    name_blocks(root, [""], model)
    assert (root.candidates[0].module_path, root.graph_name) == ("layers.0.mlp", "GraphModule")


def test_explain_runs_its_ops_with_the_density_router_paused(monkeypatch):
    """explain's analysis run must not take or set a layer's route (density_route.paused): a model later
    compiled would otherwise start from the routes of the example inputs."""
    from twell_compile import kernels
    from twell_compile.kernels import density_route

    seen = []
    real = kernels.reference_gated_relu_mlp

    def spy(*args):
        seen.append(getattr(density_route._PAUSED, "on", False))
        return real(*args)

    monkeypatch.setattr(kernels, "reference_gated_relu_mlp", spy)
    twell_compile.explain(GatedMLP(HIDDEN, INTER), _x(2, 3), print_report=False)
    assert seen == [True]
    assert getattr(density_route._PAUSED, "on", False) is False  # and restored after


@pytest.mark.skipif(not twell_compile.api._ISOLATED, reason="torch.compile has no isolate_recompiles (torch < 2.12)")
def test_explain_again_and_again_leaves_the_model_compilable():
    """Each explain call compiles with a backend of its own; kept apart from the model's compiles, they
    never fill its recompile limit, so backend="twell" still compiles the model afterwards."""
    from helpers import backend_reports

    model, x = Stack([GatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN), _x(2, 3)
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        assert twell_compile.explain(model, x, print_report=False).rewritten == 2
    before = len(backend_reports())
    with torch.no_grad():
        torch.compile(model, backend="twell")(x)
    assert [r.rewritten_count for r in backend_reports()[before:]] == [2]


def test_explain_judges_as_the_backend_does_in_the_callers_grad_mode():
    """A clamp(min=0) block is left alone where gradients may flow: explain called with gradients on
    says so, as the backend would, and rewrites it under no_grad."""
    class ClampMLP(ReluMLP):
        def forward(self, x):
            return self.fc2(self.fc1(x).clamp(min=0))

    model = ClampMLP(HIDDEN, INTER)
    assert twell_compile.explain(model, _x(2), print_report=False).rewritten == 0
    with torch.no_grad():
        assert twell_compile.explain(model, _x(2), print_report=False).rewritten == 1


def test_explain_leaves_a_training_models_buffers_as_they_were():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(HIDDEN), ReluMLP(HIDDEN, INTER)).train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    twell_compile.explain(model, _x(4), print_report=False)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


def test_rewrite_keeps_a_graphs_structured_inputs_and_outputs():
    """A graph whose codegen packs and unpacks pytrees (make_fx of a function of dicts, an exported
    module) keeps its calling convention."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mlp = ReluMLP(HIDDEN, INTER)
    with torch.no_grad():  # (with gradients, make_fx also keeps the relu's output for its backward)
        graph = make_fx(lambda d: {"out": mlp(d["x"])})({"x": _x(2)})
    rewritten, report = twell_compile.rewrite(graph)
    x = _x(3)
    out = rewritten({"x": x})
    assert report.rewritten_count == 1 and set(out) == {"out"}
    torch.testing.assert_close(out["out"], mlp(x))


def test_explain_graph_module():
    traced = fx.symbolic_trace(ReluMLP(HIDDEN, INTER))
    result = twell_compile.explain(traced, _x(2), print_report=False)
    assert (result.rewritten, result.left_alone) == (1, 0)
    assert twell_targets(traced) == []


# ---------------------------------------------------------------------------------------------------
# to_networkx
# ---------------------------------------------------------------------------------------------------


def test_to_networkx_of_rewritten_dynamo_graph():
    model = GatedMLP(HIDDEN, INTER, bias=True)
    (gm,) = capture_dynamo_graphs(model, _x(2, 5))
    rewritten, _ = twell_compile.rewrite(gm)
    g = to_networkx(rewritten)

    assert g.number_of_nodes() == len(rewritten.graph.nodes)
    (twell_node,) = [n for n, attrs in g.nodes(data=True) if attrs["twell"]]
    attrs = g.nodes[twell_node]
    assert attrs["op"] == "call_function" and "twell.gated_relu_mlp" in attrs["target"]
    assert attrs["shape"] == (2, 5, HIDDEN) and attrs["dtype"] == "torch.float32"

    predecessors = set(g.predecessors(twell_node))
    placeholders = {n for n, a in g.nodes(data=True) if a["op"] == "placeholder"}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for param in ("weight", "bias"):
            (source,) = [p for p in placeholders if proj in p and param in p]
            assert source in predecessors, f"no edge from {source} to the twell op"
    # every edge is a data use in the FX graph
    for node in rewritten.graph.nodes:
        assert set(g.predecessors(node.name)) == {a.name for a in node.all_input_nodes}
    # nothing of the old block is left
    assert not any(a["op"] == "call_function" and "relu" in a["target"] and not a["twell"] for _, a in g.nodes(data=True))
