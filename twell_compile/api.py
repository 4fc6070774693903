"""Public entry points besides the backend: ``rewrite`` for FX/exported graphs and ``explain``."""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from . import frame_names, ops  # noqa: F401  (ops: the rewritten graphs call torch.ops.twell.*)
from .options import TwellOptions, parse_options
from .passes import run_passes
from .passes.pass_manager import higher_order_bodies
from .passes.report import RewriteReport


def _twell_options(options: TwellOptions | Mapping[str, Any] | None) -> TwellOptions:
    if isinstance(options, TwellOptions):
        return options
    twell_options, inductor_patches = parse_options(options)
    if inductor_patches:
        raise ValueError(f"twell: Inductor options {sorted(inductor_patches)} only apply to torch.compile")
    return twell_options


# Keeps explain's compiled entries apart from the model's other compiles (torch.compile's
# isolate_recompiles, torch 2.12 on): each explain call's backend is a new function, so without it every
# call adds an entry to the model's frames, and after recompile_limit of them Dynamo runs the model
# eagerly, under backend="twell" too.
_ISOLATED = ({"isolate_recompiles": True}
             if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {})


def _recompile_limit_hits() -> int:
    """How often Dynamo has given up on a frame at a recompile limit in this process (its graph-break
    counter of that name; 0 where this torch counts it otherwise)."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if str(reason).startswith("Dynamo recompile limit"))


@contextlib.contextmanager
def _buffers_restored(model: torch.nn.Module):
    """Puts the model's buffers back as they were (same tensors, same values) when the block ends."""
    saved = [(module, name, buffer, buffer.detach().clone())
             for module in model.modules() for name, buffer in module._buffers.items() if buffer is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                module._buffers[name] = buffer
                buffer.copy_(value)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with its own graph but the same parameters (no weight copies). The bodies of
    higher-order ops (checkpoint regions, ...) are copied too, at any depth: the passes rewrite them in
    place, and the original's must stay as they are."""
    graph = fx.Graph()
    # The codegen packs and unpacks structured inputs and outputs (pytrees: an exported module's dicts).
    graph.set_codegen(copy_module.deepcopy(gm.graph._codegen))
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    copy = fx.GraphModule(gm, graph, class_name=gm.__class__.__name__)
    for target, body in higher_order_bodies(copy):
        owner_path, _, name = target.rpartition(".")
        setattr(copy.get_submodule(owner_path) if owner_path else copy, name, _copy_graph_module(body))
    return copy


def _as_graph_module(model: Any, example_inputs: tuple) -> fx.GraphModule:
    if isinstance(model, torch.export.ExportedProgram):
        return model.module()
    if isinstance(model, fx.GraphModule):
        return _copy_graph_module(model)
    if isinstance(model, torch.nn.Module):
        return fx.symbolic_trace(model)
    raise TypeError(
        f"twell.rewrite: expected an fx.GraphModule, a torch.export.ExportedProgram or an nn.Module, "
        f"got {type(model).__name__}"
    )


def _propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Records tensor metadata on every node so the pass can check shapes (fake tensors: no compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def rewrite(
    model: Any,
    *example_inputs: Any,
    options: TwellOptions | Mapping[str, Any] | None = None,
) -> tuple[fx.GraphModule, RewriteReport]:
    """Rewrites every ReLU MLP block of an FX graph into twell ops.

    ``model`` is an ``fx.GraphModule`` (left untouched: the result is a new module sharing its
    parameters), a ``torch.export.ExportedProgram`` (its ``.module()`` is rewritten) or an
    ``nn.Module`` (symbolically traced first). Pass ``example_inputs`` when the graph carries no
    shape metadata, so the pass can prove the weight shapes agree; blocks whose shapes cannot be
    known are left alone and the report says so. Returns ``(rewritten_module, report)``.

    ReLU spelled as ``clamp(min=0)`` is rewritten only when ``rewrite`` is called with gradients off
    (``torch.no_grad()``): the result is then meant for inference, since the twell ops' gradient at
    exactly 0 is relu's (0), not the clamp's (1). The rewritten module supports reverse-mode autograd,
    not forward-mode AD or ``torch.func.grad``/``jvp`` (PyTorch raises); ``torch.compile`` with
    ``backend="twell"`` leaves blocks inside such transforms alone.
    """
    twell_options = _twell_options(options)
    gm = _as_graph_module(model, example_inputs)
    if example_inputs:
        _propagate_shapes(gm, example_inputs)
    report = run_passes(gm, twell_options)
    return gm, report


@dataclasses.dataclass
class ExplainReport:
    """What ``backend="twell"`` would do to a model: one rewrite report per captured graph."""

    graph_reports: list[RewriteReport]
    graph_break_count: int
    sparsity: str | None = None
    """Per-call sparsity table of the twell ops on the example inputs (None for FX graphs)."""
    recompile_limit_hit: bool = False
    """Dynamo reached a recompile limit during the run: frames past it ran eagerly, uncaptured."""

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten_count for r in self.graph_reports)

    @property
    def left_alone(self) -> int:
        return sum(r.left_alone_count for r in self.graph_reports)

    def __str__(self) -> str:
        lines = [
            f"twell explain: {len(self.graph_reports)} graph(s), {self.graph_break_count} graph break(s); "
            f"{self.rewritten} block(s) rewritten, {self.left_alone} left alone"
        ]
        if self.recompile_limit_hit:
            lines.append("note: Dynamo reached its recompile limit on this run (see its warning), so the calls of "
                         "some frames past it ran eagerly and their blocks are missing here; raising "
                         "torch._dynamo.config.recompile_limit lets it capture them")
        for i, report in enumerate(self.graph_reports):
            lines.append(f"\n=== graph {i} ===")
            lines.append(str(report))
        if self.sparsity is not None:
            lines.append("\n=== sparsity of the rewritten blocks on the example inputs (one row per op call) ===")
            lines.append(self.sparsity)
        return "\n".join(lines)


def explain(
    model: Any,
    *example_inputs: Any,
    options: TwellOptions | Mapping[str, Any] | None = None,
    print_report: bool = True,
) -> ExplainReport:
    """Reports every candidate ReLU MLP block of ``model`` (rewritten or left alone, and why).

    An ``nn.Module`` is captured with Dynamo on ``example_inputs``, exactly as ``torch.compile``
    would hand it to the backend, and the rewritten graph is run once eagerly to report the active
    units per row each twell op saw, in the caller's grad mode (the backend decides some rewrites by
    it); nothing is compiled and the model is not changed: its buffers (a BatchNorm's running statistics
    in training mode) are restored after the run, and its layers' density routes are left alone (that
    run's ops take the route their row count gives and report nothing). Where torch.compile can keep a
    call's compiled entries apart (``isolate_recompiles``, torch 2.12 on), explain's do not count against
    the model's recompile limit (only against Dynamo's ``accumulated_recompile_limit``, 256 entries a
    frame across all compiles); with older torch, explaining one model more than Dynamo's
    ``recompile_limit`` (8) times fills it, and explain then says so. FX graphs and exported programs
    are analysed directly (their copy is rewritten, not the original).

    Where a graph break falls inside a layer, Dynamo compiles that layer's frame once and every layer
    runs the same graph. Its blocks are reported once: with their full paths where the graph ran for one
    module, else relative to the frame (``mlp``) under a title that lists the modules it ran for
    (``model.layers.0, model.layers.1, ..., model.layers.37``), found from the parameters each call
    was passed. The sparsity table still has a row for every op call. Where layers make Dynamo
    recompile their frame one by one (a graph break inside layers that keep per-layer cache state) and
    it reaches its recompile limit, the layers past it run eagerly, and the report says so (for limits
    reached during this call: on torch before 2.12, frames that reached it in an earlier compile of the
    model stay eager without a note).
    """
    twell_options = _twell_options(options)
    if isinstance(model, (fx.GraphModule, torch.export.ExportedProgram)) or not isinstance(model, torch.nn.Module):
        _, report = rewrite(model, *example_inputs, options=twell_options)
        result = ExplainReport([report], graph_break_count=0)
    else:
        from .kernels import density_route
        from .stats import record_sparsity

        from .backend import add_report

        captured: list[RewriteReport] = []
        captured_ids: list[object] = []
        names = frame_names.tensor_names(model)
        frames: list[tuple[RewriteReport, list]] = []  # each report, and the modules whose frame its graph ran

        def analyse(gm: fx.GraphModule, inputs):
            rewritten = _copy_graph_module(gm)
            report = run_passes(rewritten, twell_options)
            add_report(captured, captured_ids, report)  # (restarts counted once)
            frames.append((report, []))
            # Run eagerly, so the twell ops record their sparsity, noting which module each call served.
            return frame_names.recording_calls(rewritten.forward, gm, names, frames[-1][1])

        # A fresh compile of the model with a backend that only analyses; the model is run once, with the
        # density router paused, so that this run neither takes nor sets any layer's route.
        compiled = torch.compile(model, backend=analyse, **_ISOLATED)
        limit_hits = _recompile_limit_hits()
        with _buffers_restored(model), record_sparsity() as recorder, density_route.paused():
            compiled(*example_inputs)
        limit_hit = _recompile_limit_hits() > limit_hits
        if not captured:
            raise RuntimeError(
                "twell.explain: Dynamo captured no graph of the model, so it ran eagerly: its frames are "
                "skipped (torch.compiler.disable) or have reached Dynamo's recompile_limit (repeated "
                "explain calls fill it on torch older than 2.12; torch._dynamo.reset() clears it)")
        for report, seen in frames:
            if any(report is r for r in captured):  # (not one a restart replaced)
                frame_names.name_blocks(report, seen, model)
        result = ExplainReport(captured, graph_break_count=max(len(captured) - 1, 0),
                               sparsity=recorder.table() if recorder.calls() else None,
                               recompile_limit_hit=limit_hit)
    if print_report:
        print(result)
    return result
