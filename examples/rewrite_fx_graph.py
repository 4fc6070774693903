"""Rewrite a hand-written FX graph with ``twell_compile.rewrite`` and inspect the result.

A small model with one gated ReLU MLP (``down(relu(gate(x)) * up(x))``) and one non-gated one
(``fc2(relu(fc1(x)))``) is traced with ``torch.fx.symbolic_trace``; ``rewrite`` returns a new
GraphModule in which each block is one twell op (the traced module is left as it was), and the
report says what was matched. The rewritten graph is then exported to networkx.

    python examples/rewrite_fx_graph.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

import twell_compile
from twell_compile.graph_export import to_networkx


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class ReluMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TwoBlocks(nn.Module):
    def __init__(self, hidden: int = 16, intermediate: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.gated = GatedMLP(hidden, intermediate)
        self.plain = ReluMLP(hidden, intermediate)

    def forward(self, x):
        x = x + self.gated(self.norm(x))
        return x + self.plain(x)


def main() -> None:
    torch.manual_seed(0)
    model = TwoBlocks().eval()
    x = torch.randn(2, 8, 16)

    traced = fx.symbolic_trace(model)
    print("=== before ===")
    print(traced.code)

    # The example input lets the pass check every weight shape before it rewrites a block.
    rewritten, report = twell_compile.rewrite(traced, x)
    print("=== after ===")
    print(rewritten.code)
    print("=== report ===")
    print(report)

    with torch.no_grad():
        same = torch.equal(rewritten(x), model(x))
    print(f"rewritten output equals the original on CPU: {same}")

    g = to_networkx(rewritten)
    twell_nodes = [n for n, attrs in g.nodes(data=True) if attrs["twell"]]
    print(f"=== networkx: {g.number_of_nodes()} nodes, {g.number_of_edges()} edges ===")
    for n in twell_nodes:
        print(f"{n} ({g.nodes[n]['target']}) reads {sorted(g.predecessors(n))}")


if __name__ == "__main__":
    main()
