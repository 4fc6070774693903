"""Compile a tiny ReLU Llama with ``backend="twell"`` and check it against eager.

The model is built from a config with random weights (no download). Every decoder layer's MLP,
``down_proj(relu(gate_proj(x)) * up_proj(x))``, should be rewritten into one
``torch.ops.twell.gated_relu_mlp`` call; the script prints the rewrite report and the largest
difference between compiled and eager logits, and exits non-zero if either is wrong.

    python examples/compile_hf_llama.py                 # CUDA if available, else CPU
    python examples/compile_hf_llama.py --device cpu --layers 4
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import twell_compile.backend


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(64, args.seq),
        hidden_act="relu",  # ReLU-gated MLP (ReGLU): what the twell ops compute
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=176)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--mode", default=None, help='torch.compile mode, e.g. "reduce-overhead"')
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(args).to(device=device, dtype=dtype).eval()
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
        compiled = torch.compile(model, backend="twell", mode=args.mode)
        start = time.perf_counter()
        logits = compiled(input_ids, use_cache=False).logits
        compile_s = time.perf_counter() - start

    reports = twell_compile.backend.last_reports()
    print(f"device {device}, dtype {dtype}, {args.layers} layers; first compiled call took {compile_s:.1f} s")
    for i, report in enumerate(reports):
        print(f"--- graph {i} ---")
        print(report)
    rewritten = sum(r.rewritten_count for r in reports)

    # float32 on CPU computes the same ops in the same order, up to Inductor's fusion of the code
    # around the MLPs; reduced precision gets a reduced-precision tolerance.
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]
    max_diff = (logits.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    print(f"rewritten MLP blocks: {rewritten} (model has {args.layers} layers)")
    print(f"max |compiled - eager| = {max_diff:.3g} (logits up to {scale:.3g}; tolerance {tol:g} relative)")

    ok = True
    if rewritten != args.layers:
        print(f"ERROR: expected {args.layers} rewritten blocks, got {rewritten}", file=sys.stderr)
        ok = False
    if not max_diff <= tol * max(scale, 1.0):
        print("ERROR: compiled logits differ from eager", file=sys.stderr)
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
