"""Throwaway (2026-11-29), kept for the log beside it: per layer of the benchmark model, the active units
of decode-like rows (each sequence's last position) and the row-tiles past the TwELL capacity of 8 in one
32-row block. CPU only, reference math; about 10 minutes for 38 layers on 2 cores.

    python examples/results/decode_block_stats_cpu_2026-11-29.py 38
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_model import build_model  # noqa: E402

torch.manual_seed(0)
t = time.time()
layers = int(sys.argv[1])
model = build_model(layers, 24.0, 128, 'cpu')
print('built', time.time() - t, flush=True)
stats = []


def hook(module, inputs, output):
    act = output.float()[:, -1, :]  # the last position of each sequence: a decode-like token per row
    active = act > 0
    tiles = active.view(active.shape[0], -1, 128).sum(-1)
    stats.append((active.sum(1), tiles))


hs = [layer.mlp.gate_proj.register_forward_hook(hook) for layer in model.model.layers]
with torch.no_grad():
    ids = torch.randint(0, 32000, (32, 96))
    model.model(input_ids=ids, use_cache=False)
for i, (per_row, tiles) in enumerate(stats):
    over = (tiles > 8).sum().item()
    print(f"layer {i}: active per row mean {per_row.float().mean():.1f} max {per_row.max().item()} "
          f"min {per_row.min().item()}; row-tiles past cap 8 in the 32-row block: {over} (dense past 16); "
          f"max per tile {tiles.max().item()}", flush=True)
