"""How long the twell FX pass takes on the Dynamo graph of a 38-layer Llama.

The graph is captured once with a backend that only records it (nothing is compiled), then
``twell_compile.passes.run_passes`` is timed on fresh copies of it. The model is the paper's 2B shape
(38 layers, hidden 2048, intermediate 5632) built on the ``meta`` device, so no memory is spent on
weights; what the pass's time depends on is the graph (about 40 nodes a layer), not the weights.

    python examples/bench_rewrite_cost.py                   # meta device, full 2B shape
    python examples/bench_rewrite_cost.py --device cpu --hidden 64 --intermediate 176
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import fx
from transformers import LlamaConfig, LlamaForCausalLM

from twell_compile.options import TwellOptions
from twell_compile.passes import run_passes


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with its own graph (node metadata kept) sharing gm's parameters."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="meta")
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        hidden_act="relu",
    )
    with torch.device(args.device):
        model = LlamaForCausalLM(config).eval()
    input_ids = torch.zeros(1, args.seq, dtype=torch.long, device=args.device)

    graphs: list[fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(model, backend=record, fullgraph=True)(input_ids, use_cache=False)
    capture_s = time.perf_counter() - start
    (gm,) = graphs
    print(f"Dynamo graph of a {args.layers}-layer Llama (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.device}): {len(gm.graph.nodes)} nodes, captured in {capture_s:.1f} s")

    options = TwellOptions()
    times_ms = []
    report = None
    for _ in range(args.runs + 1):  # the first run warms up imports and caches and is not counted
        copy = copy_graph_module(gm)
        start = time.perf_counter()
        report = run_passes(copy, options)
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms = times_ms[1:]
    print(f"rewritten blocks: {report.rewritten_count}, left alone: {report.left_alone_count}")
    print(f"run_passes: median {statistics.median(times_ms):.1f} ms over {args.runs} runs "
          f"(min {min(times_ms):.1f} ms, max {max(times_ms):.1f} ms)")


if __name__ == "__main__":
    main()
