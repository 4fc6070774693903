"""Whole-model benchmark: the paper's 2B-shape Llama (38 layers, hidden 2048, intermediate 5632,
32 heads, ReLU MLP), dense ``torch.compile`` against ``backend="twell"``, one forward pass of
``model.model`` (no LM head), ``use_cache=False``, SDPA attention, bf16, random weights.

Sparsity is made paper-like by giving each gate projection a negative bias calibrated, layer by
layer in one pass, so that about ``--nnz`` units per token are active; the measured nonzeros per
row of every layer are printed beside the timings.

    python examples/bench_model.py --batch 64 --seq 2048 --nnz 24 [--profile]

``--profile`` also prints, for one forward pass of each, the GPU time and launches per kernel name (the
twelve largest) and the time of all kernels together.
"""

from __future__ import annotations

import argparse
import torch


def build_model(layers: int, nnz: float, seq: int, device: str = "cuda", hidden: int = 2048,
                intermediate: int = 5632, heads: int = 32, vocab: int = 32000):
    """The 2B-shape ReLU Llama by default (smaller shapes for CPU smoke runs), bf16, random weights,
    its gate biases calibrated to about ``nnz`` active units per token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, hidden_act="relu", mlp_bias=True,
                      max_position_embeddings=max(seq, 2048), attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    for layer in model.model.layers:
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            torch.nn.init.zeros_(proj.bias)
    calibrate_gate_bias(model, nnz, seq, device)
    return model


@torch.no_grad()
def calibrate_gate_bias(model, nnz: float, seq: int, device: str) -> None:
    """Sets every gate bias to minus the (1 - nnz/F) quantile of its pre-activation, in forward order,
    so later layers calibrate on the already-sparse activations of earlier ones."""
    f = model.config.intermediate_size
    quantile = 1.0 - nnz / f
    hooks = []

    def hook(module, inputs, output):
        flat = output.float().flatten()
        sample = flat[torch.randint(0, flat.numel(), (1 << 22,), device=flat.device)]
        q = torch.quantile(sample, quantile)
        module.bias.fill_(-q.to(module.bias.dtype))
        return output - q.to(output.dtype)

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate_proj.register_forward_hook(hook))
    ids = torch.randint(0, model.config.vocab_size, (2, seq), device=device)
    model.model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()


def kernel_times_ms(fn, top: int = 12) -> list[tuple[str, float, int]]:
    """GPU time of one call of ``fn`` per kernel name, (name, ms, launches), the largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1000.0  # us -> ms
            entry[1] += 1
    ranked = sorted(((name, ms, n) for name, (ms, n) in totals.items()), key=lambda t: -t[1])
    return ranked[:top] + [("(all kernels)", sum(ms for ms, _ in totals.values()), sum(n for _, n in totals.values()))]


def print_kernel_times(label: str, rows: list[tuple[str, float, int]]) -> None:
    print(f"\n{label}: GPU time per kernel, one forward")
    for name, ms, n in rows:
        print(f"  {ms:9.2f} ms  {n:5d}x  {name[:110]}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape and sparsity (also used by profile_model_layers.py)."""
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--nnz", type=float, default=24.0, help="active units per row the gate biases aim at")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel of one forward of each")
    args = parser.parse_args()

    import twell_compile
    from twell_compile.testing import cuda_time_ms

    torch.manual_seed(0)
    model = build_model(args.layers, args.nnz, args.seq)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; Llama {args.layers} layers, hidden 2048, intermediate 5632; batch {args.batch} x seq {args.seq}",
          flush=True)

    results = {}
    with torch.inference_mode():
        dense = torch.compile(model.model)
        results["dense torch.compile"] = cuda_time_ms(lambda: dense(input_ids=ids, use_cache=False), args.reps, 2)
        # The timed shape, so the timed graph and kernels (the chunked kernel at 64 x 2048): another shape
        # would compile another graph and could take other paths.
        ref = dense(input_ids=ids, use_cache=False).last_hidden_state
        print(f"dense compiled: {results['dense torch.compile']:.1f} ms", flush=True)
        if args.profile:  # before the reset below, which would make dense compile again
            print_kernel_times("dense torch.compile", kernel_times_ms(lambda: dense(input_ids=ids, use_cache=False)))

        torch._dynamo.reset()
        twell = torch.compile(model.model, backend="twell")
        results["twell"] = cuda_time_ms(lambda: twell(input_ids=ids, use_cache=False), args.reps, 2)
        rewritten = sum(r.rewritten_count for r in twell_compile.last_reports())
        out = twell(input_ids=ids, use_cache=False).last_hidden_state
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        del out, ref
        with twell_compile.record_sparsity() as rec:
            twell(input_ids=ids, use_cache=False)
        calls = rec.calls()

        if args.profile:
            print_kernel_times("twell", kernel_times_ms(lambda: twell(input_ids=ids, use_cache=False)))

    print("\nper-layer sparsity (twell run):")
    print(rec.table())
    mean_nnz = sum(c.mean_nnz_per_row for c in calls) / max(len(calls), 1)
    print(f"\nGPU: {gpu}  tokens per forward: {tokens}  MLP blocks rewritten: {rewritten}/{args.layers}  "
          f"mean nonzeros per row: {mean_nnz:.1f}  max: {max(c.max_nnz_per_row for c in calls)}  "
          f"rel. diff twell vs dense (last hidden state, every sequence): {rel:.2e}")
    base = results["dense torch.compile"]
    print(f"{'':<22} {'ms':>9} {'tokens/ms':>10} {'vs dense compile':>17}")
    for name, ms in results.items():
        print(f"{name:<22} {ms:>9.1f} {tokens / ms:>10.1f} {base / ms:>16.3f}x")


if __name__ == "__main__":
    main()
