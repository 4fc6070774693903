"""The twell MLP on each layer's real input from the whole-model benchmark, one layer at a time.

``bench_model.py`` measured the chunked sparse kernel at about 3.3 ms a layer in the 2B-shape model,
where a synthetic call at the model's mean active units per row took about 2.8 ms (H100, 2026-11-25,
before the chunks took rows in a scattered order: README, "The chunks' row order"). This script
captures every layer's MLP input from one forward pass of the same model (same calibration), then
for each layer prints the activation's shape as the chunked kernel sees it (active units per row:
mean, spread, share of rows past one piece; pieces and waves of chunks; how unevenly units and bank
groups are used; the entries of the busiest CTA over the mean, with chunks of consecutive rows and in
the kernel's scattered row order) beside the time of the chunked kernel and of the whole op on that
input (torch.profiler); optionally the same with the rows shuffled, with the units permuted, and for
a synthetic input with the layer's mean.

    python examples/profile_model_layers.py --layers 38 --batch 64 --seq 2048 --nnz 24
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twell_compile  # noqa: E402,F401
from bench_model import add_model_arguments, build_model  # noqa: E402
from twell_compile.testing import make_problem  # noqa: E402

PIECE_ENTRIES = 40      # kPieceEntries<bfloat16>, csrc/twell_sparse_chunked.cu
HEAVY_ROW_ENTRIES = 256  # kChunkMaxRowEntries: longer rows take the compact dense path
CHUNK_PIECES = 512 - 6   # kChunkPieces<bfloat16>


@torch.no_grad()
def row_counts(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int = 16384):
    """Active units per row of relu(x w^T + b), and per unit, as the gate GEMM rounds them."""
    per_row, per_unit = [], torch.zeros(w.shape[0], dtype=torch.int64, device=x.device)
    for r in range(0, x.shape[0], rows):
        z = torch.nn.functional.linear(x[r:r + rows], w, b) > 0
        per_row.append(z.sum(1))
        per_unit += z.sum(0)
    return torch.cat(per_row), per_unit


def chunk_shape(counts: torch.Tensor, sms: int) -> tuple[int, int, float]:
    """Pieces, chunks and waves of chunks that the chunked kernel makes of these rows (the dense-block
    decision aside)."""
    light = counts[(counts > 0) & (counts <= HEAVY_ROW_ENTRIES)]
    pieces = int(((light + PIECE_ENTRIES - 1) // PIECE_ENTRIES).sum())
    chunks = -(-pieces // CHUNK_PIECES)
    if chunks > sms:
        chunks = -(-chunks // sms) * sms
    return pieces, chunks, chunks / sms


ROW_ORDER_GROUP = 32  # kRowOrderGroup


def scattered_rows(m: int, device) -> torch.Tensor:
    """The chunks' row order (RowOrder in csrc/twell_sparse_chunked.cu): groups of 32 rows, group
    position q holding group q * stride mod G (G whole groups, stride coprime to G near G / golden
    ratio), the rows past the whole groups in place."""
    position = torch.arange(m, device=device, dtype=torch.int64)
    groups = m // ROW_ORDER_GROUP
    if groups <= 1:
        return position
    stride = max(1, int(groups * 0.6180339887498949 + 0.5))  # as std::llround
    while math.gcd(stride, groups) != 1:
        stride += 1
    group, offset = position // ROW_ORDER_GROUP, position % ROW_ORDER_GROUP
    scattered = group * (stride % groups) % groups * ROW_ORDER_GROUP + offset
    return torch.where(position < groups * ROW_ORDER_GROUP, scattered, position)


def cta_entry_spread(counts: torch.Tensor, sms: int) -> float:
    """Most entries any CTA gets over the mean, for rows taken in the order given: the chunks are runs
    of near-equal piece counts, and CTA b runs chunks b, b + sms, ..."""
    light = torch.where((counts > 0) & (counts <= HEAVY_ROW_ENTRIES), counts, torch.zeros_like(counts))
    pieces = torch.cumsum((light + PIECE_ENTRIES - 1) // PIECE_ENTRIES, 0)
    entries = torch.cumsum(light, 0)
    _, chunks, _ = chunk_shape(counts, sms)
    size = -(-int(pieces[-1]) // chunks)
    ends = torch.searchsorted(pieces, torch.arange(1, chunks + 1, device=counts.device) * size).clamp_max(len(counts) - 1)
    at_end = entries[ends]
    per_chunk = torch.diff(at_end, prepend=at_end.new_zeros(1)).float()
    per_cta = per_chunk.reshape(-1, min(chunks, sms)).sum(0)
    return float(per_cta.max() / per_cta.mean())


def kernel_ms(call, reps: int = 3) -> dict[str, float]:
    """Mean GPU time per call: "chunked" (the chunked kernel) and "all" (every kernel of the op)."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if "CUDA" not in str(e.device_type) or e.device_time_total <= 0:  # kernels only
            continue
        name = "chunked" if "chunked_mlp" in e.key else None
        total = e.device_time_total
        out["all"] = out.get("all", 0.0) + total / reps / 1000
        if name:
            out[name] = out.get(name, 0.0) + total / reps / 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--every", type=int, default=1, help="time every n-th layer only")
    parser.add_argument("--synthetic", action="store_true", help="also time a synthetic input with each layer's mean")
    parser.add_argument("--permute-units", action="store_true",
                        help="also time each layer with its units (rows of W_gate and W_up, columns of W_down) in a "
                             "random order: the same activation, other units and bank groups")
    parser.add_argument("--shuffle-rows", action="store_true",
                        help="also time each layer with its input rows in a random order")
    parser.add_argument("--plain", type=int, default=0, metavar="CALLS",
                        help="for Nsight Compute: only make CALLS calls on the first timed layer's input (after "
                             "the model's own forward), then CALLS on a synthetic input with its mean, no profiler")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    model = build_model(args.layers, args.nnz, args.seq)
    inputs: list[torch.Tensor] = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1]).clone()))
             for layer in model.model.layers]
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()

    if args.plain:
        mlp, x = model.model.layers[0].mlp, inputs[0]
        w = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
             mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias)
        mean = float(row_counts(x, mlp.gate_proj.weight, mlp.gate_proj.bias)[0].float().mean())
        p = make_problem(x.shape[0], x.shape[1], mlp.gate_proj.weight.shape[0], nnz_per_row=mean, bias=True)
        for args_ in (w, p.gated_args()):
            for _ in range(args.plain):
                torch.ops.twell.gated_relu_mlp(*args_)
        torch.cuda.synchronize()
        return

    print(f"GPU: {torch.cuda.get_device_name()}  layers={args.layers} tokens={args.batch}x{args.seq} nnz target={args.nnz}")
    print("layer  mean   std  p99  max  >40%  pieces  waves  unit max/mean  group max/mean | chunked ms  op ms"
          + ("  | perm chunked" if args.permute_units else "") + ("  | synth chunked  synth op" if args.synthetic else ""))
    for i, (layer, x) in enumerate(zip(model.model.layers, inputs)):
        if i % args.every:
            continue
        mlp = layer.mlp
        counts, per_unit = row_counts(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
        c = counts.float()
        pieces, chunks, waves = chunk_shape(counts, sms)
        group = torch.stack([per_unit[g::8].sum() for g in range(8)]).float()
        w = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
             mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias)
        real = kernel_ms(lambda: torch.ops.twell.gated_relu_mlp(*w))
        line = (f"{i:5d} {c.mean():5.1f} {c.std():5.1f} {c.quantile(0.99):4.0f} {int(counts.max()):4d} "
                f"{100 * (counts > PIECE_ENTRIES).float().mean():5.1f} {pieces:7d} {waves:6.2f} "
                f"{(per_unit.max() / per_unit.float().mean()):13.1f} {(group.max() / group.mean()):15.3f} | "
                f"{real.get('chunked', 0):10.2f} {real['all']:6.2f}")
        line += (f" | busiest CTA/mean, rows in order {cta_entry_spread(counts, sms):5.3f}"
                 f" scattered {cta_entry_spread(counts[scattered_rows(len(counts), counts.device)], sms):5.3f}")
        if args.shuffle_rows:
            xs = x[torch.randperm(x.shape[0], device=x.device)]
            shuffled = kernel_ms(lambda: torch.ops.twell.gated_relu_mlp(xs, *w[1:]))
            line += f" shuffled {shuffled.get('chunked', 0):5.2f}"
            del xs
        if args.permute_units:
            perm = torch.randperm(mlp.gate_proj.weight.shape[0], device=x.device)
            wp = (x, mlp.gate_proj.weight[perm].contiguous(), mlp.up_proj.weight[perm].contiguous(),
                  mlp.down_proj.weight[:, perm].contiguous(), mlp.gate_proj.bias[perm].contiguous(),
                  mlp.up_proj.bias[perm].contiguous(), mlp.down_proj.bias)
            permuted = kernel_ms(lambda: torch.ops.twell.gated_relu_mlp(*wp))
            line += f" | perm {permuted.get('chunked', 0):5.2f}"
            del wp
        if args.synthetic:
            p = make_problem(x.shape[0], x.shape[1], mlp.gate_proj.weight.shape[0], nnz_per_row=float(c.mean()), bias=True)
            synth = kernel_ms(lambda: torch.ops.twell.gated_relu_mlp(*p.gated_args()))
            line += f" | {synth.get('chunked', 0):13.2f} {synth['all']:9.2f}"
            del p
        print(line, flush=True)


if __name__ == "__main__":
    main()
