"""Small models and helpers shared by the test files (imported as ``helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _twell_kernels_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from twell_compile.kernels.build import kernels_available

    return kernels_available(torch.device("cuda"))


requires_twell_kernels = pytest.mark.skipif(not _twell_kernels_ready(),
                                            reason="needs a Hopper GPU with the TwELL kernels built")

# Kernel settings (twell_compile.testing.kernel_config overrides) of the CUDA tests. KERNELS_ONLY: the
# TwELL kernels at every row count and density, where the plan would hand a call to cuBLAS
# (config.cublas_rows) or route a dense layer there. KERNEL_PATHS: the dense-path decision forced one
# way or the other, and the kernels' own (device-side, per 128-row block), all on the TwELL kernels.
KERNELS_ONLY = dict(cublas_rows=(1, 0), route_by_density=False)
# Special-token ids inside the tiny test vocabularies (several configs default to ids past them).
SMALL_VOCAB_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

KERNEL_PATHS = {
    "sparse": dict(dense_block_density=float("inf"), decode_dense_block_density=float("inf"),
                   chunked_dense_block_density=float("inf"), heavy_block_overflow_tiles=2**31 - 1, **KERNELS_ONLY),
    "dense": dict(dense_block_density=0.0, decode_dense_block_density=0.0, chunked_dense_block_density=0.0,
                  **KERNELS_ONLY),
    "auto": KERNELS_ONLY,
}


def twell_to_dense(packed, counts, backup, tile: int = 128):
    """relu(activation) [M, F] in float64, rebuilt from the TwELL format the gate kernels write: the
    packed slots (value bits << 16 | column in tile) of row-tiles within capacity, the backup row of
    pre-activations (relu applied here) of those past it."""
    m, tiles, cap = packed.shape
    f = backup.shape[1]
    gate = torch.zeros(m, tiles, tile, dtype=torch.float64, device=packed.device)
    fits = counts <= cap
    live = (torch.arange(cap, device=packed.device) < counts[..., None]) & fits[..., None]
    words = packed.long() & 0xFFFFFFFF
    cols = words & 0xFFFF
    values = ((words >> 16) & 0xFFFF).to(torch.int16).view(backup.dtype).double()
    r, t, s = live.nonzero(as_tuple=True)
    gate[r, t, cols[r, t, s]] = values[r, t, s]
    full = torch.zeros(m, tiles * tile, dtype=torch.float64, device=packed.device)
    full[:, :f] = backup.double()
    gate = torch.where(fits[..., None], gate, full.view(m, tiles, tile).relu())
    return gate.view(m, -1)[:, :f]


# ---------------------------------------------------------------------------------------------------
# eager math of the two blocks, spelled with F.linear exactly as nn.Linear runs it
# ---------------------------------------------------------------------------------------------------


def eager_gated(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    return F.linear(F.relu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias), down_weight, down_bias)


def eager_relu(x, up_weight, down_weight, up_bias=None, down_bias=None):
    return F.linear(F.relu(F.linear(x, up_weight, up_bias)), down_weight, down_bias)


# ---------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """``down(relu(gate(x)) * up(x))``, the Llama/Qwen MLP with ReLU."""

    def __init__(self, hidden: int = 16, intermediate: int = 32, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class ReluMLP(nn.Module):
    """``down(relu(up(x)))``, the OPT/GPT-style MLP with ReLU."""

    def __init__(self, hidden: int = 16, intermediate: int = 32, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        self.fc2 = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class SiluGatedMLP(GatedMLP):
    """Same weights and shape as GatedMLP, SiLU activation: never a twell candidate."""

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block around an MLP, like a transformer layer without attention."""

    def __init__(self, mlp: nn.Module, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    """``len(mlps)`` residual blocks and a final projection: a tiny model with one MLP per layer."""

    def __init__(self, mlps: Iterable[nn.Module], hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(m, hidden) for m in mlps)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def gated_stack(layers: int = 2, hidden: int = 16, intermediate: int = 32, bias: bool = False) -> Stack:
    return Stack([GatedMLP(hidden, intermediate, bias) for _ in range(layers)], hidden)


def relu_stack(layers: int = 2, hidden: int = 16, intermediate: int = 32, bias: bool = True) -> Stack:
    return Stack([ReluMLP(hidden, intermediate, bias) for _ in range(layers)], hidden)


def mixed_stack(hidden: int = 16, intermediate: int = 32) -> Stack:
    """One gated and one non-gated layer, both with biases."""
    return Stack([GatedMLP(hidden, intermediate, bias=True), ReluMLP(hidden, intermediate, bias=True)], hidden)


class WithGraphBreakModel(nn.Module):
    """A gated block, a graph break, then a non-gated block: Dynamo captures two graphs."""

    def __init__(self, hidden: int = 16, intermediate: int = 32):
        super().__init__()
        self.first = GatedMLP(hidden, intermediate)
        self.second = ReluMLP(hidden, intermediate)

    def forward(self, x):
        x = x + self.first(x)
        torch._dynamo.graph_break()
        return x + self.second(x)


# ---------------------------------------------------------------------------------------------------
# graphs, reports, gradients
# ---------------------------------------------------------------------------------------------------


def capture_dynamo_graphs(model: Callable, *inputs, **compile_kwargs) -> list[fx.GraphModule]:
    """The FX graphs Dynamo hands a backend for ``model(*inputs)`` (the model is run once, eagerly)."""
    graphs: list[fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=record, **compile_kwargs)(*inputs)
    return graphs


def twell_targets(gm: fx.GraphModule) -> list[str]:
    """Names of the twell ops the graph calls, in graph order."""
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "twell"
    ]


def rewritten_count(reports) -> int:
    return sum(r.rewritten_count for r in reports)


def backend_reports():
    from twell_compile.backend import last_reports

    return last_reports()


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(actual: nn.Module, expected: nn.Module, **tol) -> None:
    got, want = grads_by_name(actual), grads_by_name(expected)
    assert got.keys() == want.keys() and len(want) == len(list(expected.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"gradient of {name}: {m}", **tol)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_TIMING = re.compile(r"\d+(\.\d+)?\s*(ms|us|µs|s)\b")


def normalize_text(text: str) -> str:
    """Strips what changes between runs (object addresses, timings) and trailing spaces."""
    text = _ADDRESS.sub("0x?", text)
    text = _TIMING.sub("<time>", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
