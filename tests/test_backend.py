"""``torch.compile(model, backend="twell")`` end to end on CPU: registration, modes and options,
recompiles and dynamic shapes, training and autocast."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from helpers import (
    GatedMLP,
    Stack,
    SiluGatedMLP,
    WithGraphBreakModel,
    assert_grads_close,
    backend_reports,
    gated_stack,
    mixed_stack,
    relu_stack,
    requires_cuda,
    twell_targets,
)
import twell_compile
from twell_compile import reference
from twell_compile.backend import _mode_config_patches, twell_backend
from twell_compile.options import TwellOptions, parse_options

HIDDEN = 16


def _x(*leading: int) -> torch.Tensor:
    return torch.randn(*leading, HIDDEN)


# ---------------------------------------------------------------------------------------------------
# A stand-in for Inductor: records what the backend hands to compile_fx and runs the rewritten graph
# eagerly. Used where the test is about the backend's own work (options, modes, reports), so those
# tests need no C++ compile; everything below it uses the real Inductor.
# ---------------------------------------------------------------------------------------------------


class CompileFxSpy:
    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, gm, example_inputs, config_patches=None, **kwargs):
        self.calls.append({"gm": gm, "config_patches": dict(config_patches or {}), "kwargs": kwargs})
        return gm.forward


@pytest.fixture
def compile_fx_spy(monkeypatch):
    import torch._inductor.compile_fx

    spy = CompileFxSpy()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", spy)
    return spy


# ---------------------------------------------------------------------------------------------------
# (a) registration through the torch_dynamo_backends entry point
# ---------------------------------------------------------------------------------------------------


def test_entry_point_works_without_importing_twell_compile(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        import torch
        import torch.nn.functional as F
        from torch import nn

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj = nn.Linear(16, 32, bias=False)
                self.up_proj = nn.Linear(16, 32, bias=False)
                self.down_proj = nn.Linear(32, 16, bias=False)

            def forward(self, x):
                return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))

        torch.manual_seed(0)
        model, x = MLP(), torch.randn(2, 5, 16)
        assert "twell_compile" not in sys.modules
        out = torch.compile(model, backend="twell")(x)
        assert "twell_compile.backend" in sys.modules  # loaded through the entry point

        import twell_compile.backend
        reports = twell_compile.backend.last_reports()
        print("graphs", len(reports), "rewritten", sum(r.rewritten_count for r in reports))
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        print("numerics ok")
        """
    )
    # A folder outside the repository, so only the installed package (and its entry point) can be used.
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "graphs 1 rewritten 1" in result.stdout
    assert "numerics ok" in result.stdout


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "twell"]
    assert ep.load() is twell_backend


# ---------------------------------------------------------------------------------------------------
# (b) modes and options
# ---------------------------------------------------------------------------------------------------


def test_mode_config_patches():
    assert _mode_config_patches(None) == {}
    assert _mode_config_patches("default") == {}
    assert _mode_config_patches("reduce-overhead") == {"triton.cudagraphs": True}
    max_autotune = _mode_config_patches("max-autotune")
    assert max_autotune["max_autotune"] is True and max_autotune["triton.cudagraphs"] is True
    no_cudagraphs = _mode_config_patches("max-autotune-no-cudagraphs")
    assert no_cudagraphs["max_autotune"] is True and not no_cudagraphs.get("triton.cudagraphs", False)


def test_every_mode_of_this_torchs_inductor_is_taken():
    for mode, patches in _inductor_modes().items():
        assert _mode_config_patches(mode) == patches, mode


def _inductor_modes() -> dict:
    import torch._inductor

    return torch._inductor.list_mode_options()


@pytest.mark.skipif("lite" not in _inductor_modes(), reason="this torch's Inductor has no lite mode")
def test_lite_mode_compiles(compile_fx_spy):
    model, x = GatedMLP(), _x(2, 3)
    out = torch.compile(model, backend="twell", mode="lite")(x)
    torch.testing.assert_close(out, model(x))
    (call,) = compile_fx_spy.calls
    assert call["config_patches"] == _inductor_modes()["lite"]
    assert twell_targets(call["gm"]) == ["twell.gated_relu_mlp.default"]


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"twell: unknown mode 'fastest'; expected one of default, .*reduce-overhead"):
        _mode_config_patches("fastest")


def test_cuda_graphs_keep_cupti_as_torch_compile_does(monkeypatch):
    from torch import _utils_internal

    from twell_compile import backend

    monkeypatch.setattr(os, "environ", {})  # (a stand-in the backend writes to, dropped after the test)
    monkeypatch.setattr(_utils_internal, "profiler_allow_cudagraph_cupti_lazy_reinit_cuda12", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    backend._keep_cupti_for_cuda_graphs()
    assert "TEARDOWN_CUPTI" not in os.environ
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    backend._keep_cupti_for_cuda_graphs()
    assert (os.environ["DISABLE_CUPTI_LAZY_REINIT"], os.environ["TEARDOWN_CUPTI"]) == ("1", "0")


def test_unknown_mode_through_torch_compile(compile_fx_spy):
    compiled = torch.compile(GatedMLP(), backend="twell", mode="fastest")
    with pytest.raises(Exception, match=r"unknown mode 'fastest'"):
        compiled(_x(3))
    assert compile_fx_spy.calls == []


def test_reduce_overhead_reaches_inductor_as_cudagraphs(compile_fx_spy):
    model, x = GatedMLP(), _x(2, 3)
    out = torch.compile(model, backend="twell", mode="reduce-overhead")(x)
    (call,) = compile_fx_spy.calls
    assert call["config_patches"] == {"triton.cudagraphs": True}
    assert twell_targets(call["gm"]) == ["twell.gated_relu_mlp.default"]
    assert torch.equal(out, model(x))


def test_inductor_options_pass_through(compile_fx_spy):
    model, x = GatedMLP(), _x(2, 3)
    options = {"max_autotune_gemm": True, "epilogue_fusion": False, "gated": True}
    torch.compile(model, backend="twell", options=options)(x)
    (call,) = compile_fx_spy.calls
    assert call["config_patches"] == {"max_autotune_gemm": True, "epilogue_fusion": False}


def test_inductor_option_is_applied_by_inductor():
    # A real compile: Inductor runs the custom post-grad pass handed over through options, and the
    # twell op reaches Inductor's post-grad graph (as an extern call, not decomposed).
    seen_targets: list[list[str]] = []

    def record_post_grad(graph: torch.fx.Graph) -> None:
        seen_targets.append([str(n.target) for n in graph.nodes if n.op == "call_function"])

    model, x = GatedMLP(), _x(2, 3)
    with torch.no_grad():
        out = torch.compile(model, backend="twell", options={"post_grad_custom_post_pass": record_post_grad})(x)
        expected = model(x)
    assert seen_targets, "Inductor did not run the post-grad pass given in options"
    assert any("twell.gated_relu_mlp.default" in targets for targets in seen_targets)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options, gated, non_gated",
    [({}, 1, 1), ({"gated": False}, 0, 1), ({"non_gated": False}, 1, 0), ({"gated": False, "non_gated": False}, 0, 0)],
    ids=["defaults", "no-gated", "no-non-gated", "neither"],
)
def test_gated_and_non_gated_switches(compile_fx_spy, options, gated, non_gated):
    model, x = mixed_stack(HIDDEN, 32), _x(2, 3)
    out = torch.compile(model, backend="twell", options=options)(x)
    (report,) = backend_reports()
    assert report.gated_count == gated
    assert report.non_gated_count == non_gated
    (call,) = compile_fx_spy.calls
    expected_ops = ["twell.gated_relu_mlp.default"] * gated + ["twell.relu_mlp.default"] * non_gated
    assert twell_targets(call["gm"]) == expected_ops
    assert call["config_patches"] == {}
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_debug_prints_the_report(compile_fx_spy, capsys):
    torch.compile(mixed_stack(HIDDEN, 32), backend="twell", options={"debug": True})(_x(4))
    printed = capsys.readouterr().out
    (report,) = backend_reports()
    assert str(report).splitlines()[0].split("[")[0] in printed
    assert "2 rewritten (1 gated, 1 non-gated)" in printed
    assert "REWRITTEN" in printed and "twell.gated_relu_mlp" in printed and "twell.relu_mlp" in printed


def test_no_debug_prints_nothing(compile_fx_spy, capsys):
    torch.compile(mixed_stack(HIDDEN, 32), backend="twell")(_x(4))
    assert "twell" not in capsys.readouterr().out


def test_unknown_option_names_it_and_suggests(compile_fx_spy):
    compiled = torch.compile(GatedMLP(), backend="twell", options={"gatd": True})
    with pytest.raises(Exception, match=r"twell: unknown option 'gatd'\. Did you mean 'gated'"):
        compiled(_x(3))
    assert compile_fx_spy.calls == []


def test_parse_options():
    assert parse_options(None) == (TwellOptions(), {})
    assert parse_options({"non_gated": False, "max_autotune": True}) == (
        TwellOptions(non_gated=False),
        {"max_autotune": True},
    )
    with pytest.raises(ValueError, match=r"unknown option 'non_gatd'\. Did you mean 'non_gated'"):
        parse_options({"non_gatd": False})
    with pytest.raises(ValueError, match=r"twell options are gated, non_gated, debug"):
        parse_options({"zzzzzz": 1})
    with pytest.raises(TypeError, match=r"option 'gated' must be a bool, got 'yes'"):
        parse_options({"gated": "yes"})
    with pytest.raises(TypeError, match=r"options must be a dict, got list"):
        parse_options(["gated"])


def test_inductor_options_take_dashed_names_and_are_type_checked():
    """As with backend="inductor": a dashed spelling names the same setting, and a value of the wrong
    type is an error (a string "False" must not turn a bool setting on)."""
    assert parse_options({"max-autotune": False}) == (TwellOptions(), {"max_autotune": False})
    with pytest.raises(TypeError, match=r"Inductor option 'max_autotune' must be a bool, got 'False'"):
        parse_options({"max_autotune": "False"})


def test_reports_of_a_new_model_after_a_dynamo_reset_are_kept(compile_fx_spy):
    """Compile ids start over after torch._dynamo.reset(): a new model's first graph then has the id of
    the last report's, and must be added, not take that report's place."""
    import twell_compile.backend as backend

    backend._REPORTS.clear()
    backend._REPORT_IDS.clear()
    torch.compile(GatedMLP(), backend="twell")(_x(3))
    torch._dynamo.reset()
    torch.compile(relu_stack(1), backend="twell")(_x(3))
    assert [(r.gated_count, r.non_gated_count) for r in twell_compile.last_reports()] == [(1, 0), (0, 1)]


def test_unexpected_backend_argument():
    gm = torch.fx.symbolic_trace(GatedMLP())
    with pytest.raises(TypeError, match=r"unexpected backend arguments \['fast'\]"):
        twell_backend(gm, [_x(2)], fast=True)


# ---------------------------------------------------------------------------------------------------
# (c) recompiles, dynamic shapes, fullgraph, graph breaks, models with nothing to rewrite
# (real Inductor compiles from here on)
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_recompiles_with_new_shapes():
    model = gated_stack(layers=2, hidden=HIDDEN).eval()
    compiled = torch.compile(model, backend="twell")
    for shape in [(2, 5), (3, 7), (4, 9)]:
        x = _x(*shape)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    reports = backend_reports()
    # The second shape recompiles (Dynamo then marks the sizes dynamic); the third reuses that graph.
    assert len(reports) == 2
    assert [r.rewritten_count for r in reports] == [2, 2]


@torch.no_grad()
def test_dynamic_true_compiles_once():
    model = relu_stack(layers=2, hidden=HIDDEN).eval()
    compiled = torch.compile(model, backend="twell", dynamic=True)
    for shape in [(2, 5), (3, 11), (5, 2), (4, 7)]:  # same rank; sizes 0 and 1 would specialize
        x = _x(*shape)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile for new sizes
    # Under dynamic=True Dynamo may restart its analysis once (to specialize LayerNorm's float eps),
    # calling the backend again for the same frame; every attempt must rewrite both blocks.
    reports = backend_reports()
    assert 1 <= len(reports) <= 2
    assert all(r.rewritten_count == 2 and r.non_gated_count == 2 for r in reports)


@torch.no_grad()
def test_fullgraph():
    model = mixed_stack(HIDDEN, 32).eval()
    x = _x(2, 6)
    out = torch.compile(model, backend="twell", fullgraph=True)(x)
    (report,) = backend_reports()
    assert (report.gated_count, report.non_gated_count, report.left_alone_count) == (1, 1, 0)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_graph_break_each_graph_rewritten():
    model, x = WithGraphBreakModel(HIDDEN, 32), _x(3, 4)
    out = torch.compile(model, backend="twell")(x)
    reports = backend_reports()
    assert [(r.gated_count, r.non_gated_count) for r in reports] == [(1, 0), (0, 1)]
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


class _Checkpointed(nn.Module):
    """Each block under ``torch.utils.checkpoint``: Dynamo puts it in a higher-order op's subgraph."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_blocks_inside_checkpointed_regions_are_rewritten():
    import copy

    torch.manual_seed(0)
    model = _Checkpointed([GatedMLP(HIDDEN, 32, bias=True), GatedMLP(HIDDEN, 32)])
    compiled_model = copy.deepcopy(model)
    x = _x(3, 4)
    out = torch.compile(compiled_model, backend="twell")(x)
    assert sum(r.gated_count for r in backend_reports()) == 2
    expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_close(compiled_model, model, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_model_without_relu_mlp_is_unchanged():
    model = Stack([SiluGatedMLP(HIDDEN, 32), SiluGatedMLP(HIDDEN, 32)], HIDDEN).eval()
    x = _x(2, 5)
    out = torch.compile(model, backend="twell")(x)
    (report,) = backend_reports()
    assert report.rewritten_count == 0
    # The SiLU blocks have the right shape and are reported as near misses, not silently skipped.
    assert all("silu" in reason.lower() for reason in report.reasons)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# (d) training
# ---------------------------------------------------------------------------------------------------


class CountingBackward:
    """Wraps a reference backward to count how often autograd (or AOTAutograd's tracing) used it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("kind", ["gated", "non_gated"])
def test_training_gradients_match_eager(monkeypatch, kind):
    torch.manual_seed(1)
    if kind == "gated":
        model = gated_stack(layers=2, hidden=HIDDEN, bias=True)
        backward_name = "gated_relu_mlp_backward"
    else:
        model = relu_stack(layers=2, hidden=HIDDEN, bias=True)
        backward_name = "relu_mlp_backward"
    eager_model = _clone_module(model)
    counter = CountingBackward(getattr(reference, backward_name))
    monkeypatch.setattr(reference, backward_name, counter)

    x = _x(3, 5)
    x_compiled, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    target = torch.randn(3, 5, HIDDEN)
    # Caches off: the backward must be traced in this test, not loaded from an earlier run's cache.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ):
        compiled = torch.compile(model, backend="twell")
        loss = nn.functional.mse_loss(compiled(x_compiled), target)
        loss.backward()
    eager_loss = nn.functional.mse_loss(eager_model(x_eager), target)
    eager_loss.backward()

    (report,) = backend_reports()
    assert report.rewritten_count == 2
    assert counter.calls > 0, "the compiled backward did not come from the twell op's autograd formula"
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, eager_model, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-4, atol=1e-5)


def _clone_module(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------------
# (e) autocast
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_autocast_bfloat16_around_compiled_model():
    model = mixed_stack(HIDDEN, 32).eval()
    x = _x(2, 8)
    compiled = torch.compile(model, backend="twell")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        expected = model(x)
    (report,) = backend_reports()
    assert (report.gated_count, report.non_gated_count) == (1, 1)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------
# GPU: reduce-overhead really captures CUDA graphs around the twell ops
# ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@torch.no_grad()
def test_reduce_overhead_captures_cuda_graphs_on_gpu():
    model = mixed_stack(64, 256).to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
    for _ in range(3):  # warm-up, recording, replay
        out = compiled(x).clone()
    expected = model(x)
    reports = backend_reports()
    assert sum(r.gated_count for r in reports) == 1 and sum(r.non_gated_count for r in reports) == 1
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2)


def test_inductor_prefix_names_inductors_own_option():
    """``debug`` is twell's; ``inductor.debug`` is Inductor's (the prefix reaches any Inductor option)."""
    assert parse_options({"inductor.debug": True}) == (TwellOptions(), {"debug": True})
    assert parse_options({"inductor.max-autotune": True, "debug": True}) == (TwellOptions(debug=True),
                                                                            {"max_autotune": True})
    with pytest.raises(ValueError, match=r"twell: unknown option 'inductor.no_such_option'"):
        parse_options({"inductor.no_such_option": True})
