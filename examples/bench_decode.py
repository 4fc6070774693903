"""Decode benchmark: the 2B-shape ReLU Llama generating token by token from a static KV cache, dense
``torch.compile`` against ``backend="twell"``, both in one run.

Each backend compiles ``model.model`` (no LM head, as ``bench_model.py``) with the same ``--mode``
(``reduce-overhead``, CUDA graphs, by default: the way decode is served), prefills a static cache
with the same prompt, and is timed over ``--steps`` single-token steps after warm-up steps (CUDA
events around the whole loop; the input tokens are drawn beforehand, so nothing syncs in it). Every
step's MLPs see ``--batch`` rows: 1-32 run TwELL's decode path, 33-512 its cuBLAS route. The last
hidden state after the same tokens is compared between the two, and the active units per row the
MLPs see while decoding the same tokens are measured (on the eager model, untimed); the table is
printed last.

    python examples/bench_decode.py --batch 1 8 32 --steps 64
    python examples/bench_decode.py --batch 1 32 --profile 16   # and each backend's GPU time per kernel
    python examples/bench_decode.py --device cpu --layers 1 --hidden 64 --intermediate 256 --heads 4 \\
        --vocab 128 --steps 3 --warmup 1 --mode default   # a smoke run on CPU (reference ops)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_model import build_model, kernel_times_ms


def _time_ms(fn, device: str) -> float:
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode scripts' model and device options (``build_model``'s arguments): the 2B shape on CUDA."""
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--nnz", type=float, default=24.0, help="active units per token the gate biases aim at")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda")


def prefilled_decoder(model, step, prompt: torch.Tensor, tokens: torch.Tensor, device: str):
    """A fresh static cache holding ``prompt`` (prefilled eagerly, by the uncompiled model: only the
    steps are timed), and ``run(first, count)`` feeding ``tokens[:, first:first + count]`` one token a
    step through ``step`` (``model.model`` compiled), returning the last step's hidden state. Each round
    of steps needs its own cache: recent transformers' StaticCache counts the tokens written to it, so
    it fills up."""
    from transformers import StaticCache

    batch, prompt_len = prompt.shape
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + tokens.shape[1])
    positions = torch.arange(prompt_len + tokens.shape[1], device=device)
    model.model(input_ids=prompt, past_key_values=cache, cache_position=positions[:prompt_len], use_cache=True)

    def run(first: int, count: int):
        out = None
        for i in range(first, first + count):
            pos = positions[prompt_len + i:prompt_len + i + 1]
            out = step(input_ids=tokens[:, i:i + 1], past_key_values=cache, cache_position=pos,
                       position_ids=pos.expand(batch, 1), use_cache=True).last_hidden_state
        return out

    return run


def decode_sparsity(model, prompt: torch.Tensor, tokens: torch.Tensor, device: str) -> tuple[float, int]:
    """(mean, max) active units per row of the MLPs' ReLU over every decode step of ``tokens`` after the
    prompt, measured on the eager model (hooks on the gate projections; the counts stay on the device
    until the end): the sparsity the timed steps decode at, which the gate biases, calibrated on a
    prefill, only aim at."""
    counts: list[torch.Tensor] = []

    def count(module, inputs, output):
        counts.append((output > 0).sum(-1).flatten())

    run = prefilled_decoder(model, model.model, prompt, tokens, device)  # (the prompt is not counted)
    hooks = [layer.mlp.gate_proj.register_forward_hook(count) for layer in model.model.layers]
    try:
        run(0, tokens.shape[1])
    finally:
        for hook in hooks:
            hook.remove()
    per_row = torch.cat(counts).float()
    return per_row.mean().item(), int(per_row.max().item())


def decode_run(model, backend: str, mode: str, prompt: torch.Tensor, tokens: torch.Tensor, warmup: int,
               rounds: int, device: str, profile_steps: int = 0) -> tuple[list[float], torch.Tensor, list]:
    """(ms per step of each timed round, the last hidden state after the prompt and all of ``tokens``
    that the first round fed, and with ``profile_steps`` the GPU time per kernel of that many steps
    after the last round, in ms per step: (name, ms, launches per step))."""

    torch._dynamo.reset()
    step = torch.compile(model.model, backend=backend, mode=mode)
    steps = tokens.shape[1] - warmup

    def prefilled_round():
        run = prefilled_decoder(model, step, prompt, tokens, device)
        run(0, warmup)  # compiles (first round), records the CUDA graphs, warms the caches
        return run

    per_step, last = [], None
    for _ in range(rounds):
        run = prefilled_round()
        result = []
        per_step.append(_time_ms(lambda: result.append(run(warmup, steps)), device) / steps)
        if last is None:
            last = result[0].float().clone()
    kernels = []
    if profile_steps:
        # kernel_times_ms calls its function twice (a warm-up, then the profiled call): each call takes
        # the next profile_steps tokens of one more round, within the cache (main checks 2x <= steps).
        run, fed = prefilled_round(), warmup

        def next_steps():
            nonlocal fed
            run(fed, profile_steps)
            fed += profile_steps

        kernels = [(name, ms / profile_steps, n / profile_steps)
                   for name, ms, n in kernel_times_ms(next_steps, top=16)]
    return per_step, last, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (prefilled, not timed)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per round")
    parser.add_argument("--warmup", type=int, default=8, help="untimed decode steps before them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default="reduce-overhead")
    add_model_arguments(parser)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also print each backend's GPU time per kernel over this many steps (CUDA only)")
    args = parser.parse_args()
    if args.profile and args.device != "cuda":
        parser.error("--profile needs --device cuda")
    if 2 * args.profile > args.steps:
        parser.error("--profile takes at most half of --steps steps (it feeds them twice, warm-up and profiled)")

    import twell_compile  # registers backend="twell"
    from twell_compile.backend import clear_reports

    torch.manual_seed(0)
    model = build_model(args.layers, args.nnz, max(args.prompt, 64), args.device, args.hidden, args.intermediate,
                        args.heads, args.vocab)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}; Llama {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}; prompt "
          f"{args.prompt}, {args.warmup} + {args.steps} steps a round, {args.rounds} rounds; mode {args.mode}",
          flush=True)
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            prompt = torch.randint(0, args.vocab, (batch, args.prompt), device=args.device)
            tokens = torch.randint(0, args.vocab, (batch, args.warmup + args.steps), device=args.device)
            dense, dense_last, dense_kernels = decode_run(model, "inductor", args.mode, prompt, tokens, args.warmup,
                                                          args.rounds, args.device, args.profile)
            clear_reports()  # (reports pile up across batches: count this batch's only)
            twell, twell_last, twell_kernels = decode_run(model, "twell", args.mode, prompt, tokens, args.warmup,
                                                          args.rounds, args.device, args.profile)
            for label, kernels in (("dense", dense_kernels), ("twell", twell_kernels)):
                if kernels:
                    print(f"\nbatch {batch}, {label}: GPU time per kernel, per decode step (the 16 largest, then all)")
                    for name, ms, n in kernels:
                        print(f"  {ms * 1e3:9.1f} us  {n:6.1f}x  {name[:110]}")
            rewritten = sum(r.rewritten_count for r in twell_compile.last_reports())
            rel = ((twell_last - dense_last).norm() / dense_last.norm()).item()
            nnz_mean, nnz_max = decode_sparsity(model, prompt, tokens, args.device)
            rows.append((batch, statistics.median(dense), statistics.median(twell), rel, rewritten, nnz_mean, nnz_max))
            print(f"batch {batch}: dense {dense} ms/step, twell {twell} ms/step, rel. diff {rel:.2e}, "
                  f"MLP blocks rewritten in the last graph compiled: {rewritten}/{args.layers}, active units per "
                  f"row while decoding: mean {nnz_mean:.1f}, max {nnz_max} of {args.intermediate}", flush=True)
    print(f"\n{name}; ms per decode step (median of {args.rounds} rounds of {args.steps} steps); mode {args.mode}")
    print("| batch | dense compile ms | twell ms | speedup | rel. diff of the last hidden state | MLPs rewritten "
          "| active units per row while decoding (mean / max) |")
    print("|---|---|---|---|---|---|---|")
    for batch, dense, twell, rel, rewritten, nnz_mean, nnz_max in rows:
        print(f"| {batch} | {dense:.3f} | {twell:.3f} | {dense / twell:.3f}x | {rel:.2e} | {rewritten}/{args.layers} "
              f"| {nnz_mean:.1f} / {nnz_max} |")


if __name__ == "__main__":
    main()
