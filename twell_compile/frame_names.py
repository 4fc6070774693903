"""Full module paths for the blocks of graphs Dynamo captured from a sub-frame (for ``explain``).

Where a graph break falls inside a layer, Dynamo compiles the layer's own frame, and its graph's
module paths are relative to that frame's ``self`` (``mlp``, not ``model.layers.3.mlp``). Since nn
modules' parameters are graph inputs, the graph cannot tell which layer it serves, and one graph
serves all of them. Its calls can: each passes the parameters of one layer. A graph input's Dynamo
source names its path below the frame (``L['self']._modules['mlp']._parameters['weight']`` is
``mlp.weight``), the model names the tensor passed (``model.layers.3.mlp.weight``), and the difference
is the frame's module: ``model.layers.3``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import fx

from .passes.fx_utils import clean_module_path
from .passes.report import RewriteReport

_TENSOR_ATTRIBUTE = re.compile(r"\._(?:parameters|buffers)\['([^']*)'\]")


def _source_name(node: fx.Node) -> str | None:
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name  # (a method in older torch, a property in 2.11 on)


def parameter_inputs(gm: fx.GraphModule) -> list[tuple[int, str]]:
    """(input index, path below the frame) of the graph's inputs that Dynamo took from modules'
    parameters or buffers (``mlp.gate_proj.weight``)."""
    found = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        name = _source_name(node)
        if name is None or not _TENSOR_ATTRIBUTE.search(name):
            continue
        found.append((index, clean_module_path(_TENSOR_ATTRIBUTE.sub(r".\1", name))))
    return found


def frame_module(args: Sequence, inputs: list[tuple[int, str]], tensor_names: dict[int, list[str]]) -> str | None:
    """The path of the module whose frame a call of the graph ran (``""``: the model itself), from the
    tensors it was passed: the one prefix every input's names allow (a tied weight has several names,
    so several prefixes); None if the inputs name no module, or more than one."""
    common: set[str] | None = None
    for index, relative in inputs:
        names = tensor_names.get(id(args[index]), ()) if index < len(args) else ()
        if not names:
            continue  # not the model's (a tensor from elsewhere): says nothing about the frame
        prefixes = {"" if full == relative else full[: -len(relative) - 1]
                    for full in names if full == relative or full.endswith("." + relative)}
        common = prefixes if common is None else common & prefixes
    return next(iter(common)) if common is not None and len(common) == 1 else None


def tensor_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """id of each of the model's parameters and buffers -> all its names (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return names


UNKNOWN = None
"""What ``recording_calls`` notes for a call whose frame module its inputs do not tell."""


def recording_calls(forward: Callable, gm: fx.GraphModule, names: dict[int, list[str]],
                    seen: list[str | None]) -> Callable:
    """``forward``, noting in ``seen`` (once each) the frame module of each call, or ``UNKNOWN``."""
    inputs = parameter_inputs(gm)
    if not inputs:
        return forward

    def run(*args):
        module = frame_module(args, inputs, names)
        if module not in seen:
            seen.append(module)
        return forward(*args)

    return run


def _module_name(frame: str) -> str:
    return frame or "<model>"


def name_blocks(report: RewriteReport, frames: list[str | None], model: torch.nn.Module) -> None:
    """Gives ``report`` the frame modules its graph ran for (``frames``, from ``recording_calls``).
    One module other than the model itself, and every call known: its blocks get full paths (a block
    whose path is not a module below the frame, such as a node range, is named after the frame). Several,
    or calls of an unknown module: the report's title lists them, and block paths stay relative."""
    known = [f for f in frames if f is not UNKNOWN]
    unknown = len(known) < len(frames)
    if not known or (known == [""] and not unknown):
        return  # the model's own frame, or nothing to tell
    if len(known) == 1 and not unknown:
        frame = known[0]
        for block in report.candidates:
            full = f"{frame}.{block.module_path}" if block.module_path else frame
            try:
                model.get_submodule(full)
            except AttributeError:
                full = f"{frame} ({block.module_path})"
            block.module_path = full
        report.graph_name = f"the frame of {frame}"
        return
    names = [_module_name(f) for f in known]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    also = " and calls of a module its inputs do not name" if unknown else ""
    modules = f"{len(known)} module{'' if len(known) == 1 else 's'}"
    report.graph_name = f"one frame, run for {modules}: {shown}{also} (block paths are relative to each)"
