"""Runs the twell graph passes in order, times them and gathers one report (after vLLM's pass manager)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from torch import fx
from torch._ops import HigherOrderOperator

from .relu_mlp_fusion import ReluMlpFusionPass
from .report import CandidateBlock, RewriteReport


class GraphPass(Protocol):
    """A pass: mutates the GraphModule in place (recompiling it if changed) and reports its candidates."""

    name: str

    def __call__(self, gm: fx.GraphModule) -> list[CandidateBlock]: ...


class TwellPassManager:
    """The ordered passes the twell backend runs on every graph.

    ``options`` is duck-typed: anything with the boolean attributes of ``TwellOptions`` (``gated``,
    ``non_gated``, ``debug``), or None for the defaults. With ``debug`` on, the graph is linted after
    every pass so a broken rewrite is caught at the pass that made it.
    """

    def __init__(self, options: Any = None, passes: list[GraphPass] | None = None) -> None:
        self.options = options
        self.debug = bool(getattr(options, "debug", False))
        self.passes: list[GraphPass] = list(passes) if passes is not None else self.default_passes(options)

    @staticmethod
    def default_passes(options: Any) -> list[GraphPass]:
        return [ReluMlpFusionPass(options)]

    def add_pass(self, graph_pass: GraphPass | Callable[[fx.GraphModule], list[CandidateBlock]]) -> None:
        self.passes.append(graph_pass)

    def __call__(self, gm: fx.GraphModule) -> RewriteReport:
        report = RewriteReport(graph_name=type(gm).__name__)
        start = time.perf_counter()
        graphs = [gm, *_subgraphs(gm)]
        for graph_pass in self.passes:
            name = getattr(graph_pass, "name", type(graph_pass).__name__)
            pass_start = time.perf_counter()
            for graph in graphs:
                report.merge(graph_pass(graph))
                if self.debug:
                    graph.graph.lint()
            report.pass_times_s[name] = report.pass_times_s.get(name, 0.0) + time.perf_counter() - pass_start
        report.elapsed_s = time.perf_counter() - start
        return report

    def __repr__(self) -> str:
        names = ", ".join(getattr(p, "name", type(p).__name__) for p in self.passes)
        return f"TwellPassManager([{names}])"


def higher_order_bodies(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """``(attribute, body)`` of each GraphModule that a higher-order op of ``gm``'s own graph takes (one
    level deep). (Only bodies a higher-order op takes: a GraphModule a model holds as an ordinary
    submodule is the model's, not ours to change.)"""
    found: list[tuple[str, fx.GraphModule]] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not any(
                user.op == "call_function" and isinstance(user.target, HigherOrderOperator) for user in node.users):
            continue
        body = getattr(gm, node.target, None)
        if isinstance(body, fx.GraphModule) and all(body is not seen for _, seen in found):
            found.append((node.target, body))
    return found


def _subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs of higher-order ops' bodies, at any depth: ``torch.utils.checkpoint`` regions
    (``tag_activation_checkpoint``), ``wrap``, ... Dynamo stores them as GraphModule attributes of the
    graph that calls them, with their inputs (weights too) as placeholders. A body is a function of
    its inputs, so a block inside it is rewritten as anywhere else."""
    found: list[fx.GraphModule] = []
    for _, body in higher_order_bodies(gm):
        if all(body is not seen for seen in found):
            found += [body, *_subgraphs(body)]
    return found


def run_passes(gm: fx.GraphModule, options: Any = None) -> RewriteReport:
    """Runs the default twell passes on ``gm`` (mutated in place and recompiled) and returns the report."""
    return TwellPassManager(options)(gm)
