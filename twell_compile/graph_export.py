"""Export of an FX graph to ``networkx`` for inspection (reachability, neighbourhoods, drawing)."""

from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from .passes.fx_utils import node_tensor_meta


def _is_twell_node(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "twell"


def to_networkx(gm: fx.GraphModule | fx.Graph) -> nx.DiGraph:
    """A directed graph with one vertex per FX node (by node name) and one edge from
    each node to each node that reads it (a node read twice by one user gives one edge).

    Vertex attributes: ``op`` (placeholder, call_function, ...), ``target`` (a readable name),
    ``twell`` (True for twell op calls), and ``shape`` / ``dtype`` where the node carries metadata.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    out = nx.DiGraph()
    for node in graph.nodes:
        attrs = {"op": node.op, "target": fx.node._get_qualified_name(node.target) if callable(node.target) else str(node.target),
                 "twell": _is_twell_node(node)}
        meta = node_tensor_meta(node)
        if meta is not None:
            attrs["shape"] = tuple(meta.shape)
            attrs["dtype"] = str(meta.dtype)
        out.add_node(node.name, **attrs)
        for arg in node.all_input_nodes:
            out.add_edge(arg.name, node.name)
    return out
