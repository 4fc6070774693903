"""Default-mode decode (torch.compile without CUDA graphs) with and without leases, in one process: the
2B-shape ReLU Llama decoding from a static cache, dense ``torch.compile`` against ``backend="twell"``
with ``config.fast_calls`` on (a layer's repeat calls run from its lease in C++,
``twell_compile/kernels/leases.py``) and off (every call through the op's Python path).

Without graphs the host paces each step, and hosts differ from process to process and drift within one
(the tenth session saw the same dense step take 10 and 18 ms in two processes), so the three variants
share one process, both backends compiled side by side (each with its own static cache), and every
round runs each variant once, in an order reversed every other round. Wall ms per step of each round
(synced at its end), the medians, the ratios against dense, and per round the op's calls that took the
Python path (``twell_mlp``) per step.

    python examples/ab_decode_leases.py --batch 1 8 --rounds 4 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_decode import add_model_arguments, decode_sparsity, prefilled_decoder
from bench_model import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per variant")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    add_model_arguments(parser)
    args = parser.parse_args()

    import twell_compile  # noqa: F401  (registers backend="twell")
    from twell_compile.kernels import twell_mlp as tm
    from twell_compile.testing import kernel_config

    torch.manual_seed(0)
    model = build_model(args.layers, args.nnz, max(args.prompt, 64), args.device, args.hidden, args.intermediate,
                        args.heads, args.vocab)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(torch.cuda.get_device_name() if args.device == "cuda" else "CPU", flush=True)
    python_calls = [0]
    python_path = tm.twell_mlp

    def counted(*a, **k):
        python_calls[0] += 1
        return python_path(*a, **k)

    tm.twell_mlp = counted  # ops reach it through the module attribute (kernels/__init__.py)
    variants = [("dense", "inductor", None), ("twell, leases", "twell", True), ("twell, no leases", "twell", False)]
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            decoders = {}  # backend: [the step function over its own static cache, tokens fed]
            # One prompt and token stream for both backends, long enough for twell's two variants, so that
            # both caches have one length (a static cache attends over all of it) and see the same tokens.
            rounds = max(sum(b == backend for _, b, _ in variants) for backend in ("inductor", "twell")) * args.rounds
            ids = torch.randint(0, args.vocab, (batch, args.prompt + args.warmup + rounds * (args.steps + 2)),
                                device=args.device)
            for backend in ("inductor", "twell"):
                step = torch.compile(model.model, backend=backend)  # both stay compiled: no recompiles
                run = prefilled_decoder(model, step, ids[:, :args.prompt], ids[:, args.prompt:], args.device)
                run(0, args.warmup)
                decoders[backend] = [run, args.warmup]
            times: dict[str, list[float]] = {}
            for round_index in range(args.rounds):
                # every round runs each variant once, in an order reversed every other round (drift)
                for name, backend, fast in variants if round_index % 2 == 0 else variants[::-1]:
                    run, fed = decoders[backend]
                    with kernel_config(**({} if fast is None else {"fast_calls": fast})):
                        run(fed, 2)  # the first steps after a change of setting grant the leases again
                        sync()
                        python_calls[0] = 0
                        began = time.perf_counter()
                        run(fed + 2, args.steps)
                        sync()
                        ms = (time.perf_counter() - began) * 1e3 / args.steps
                    decoders[backend][1] = fed + 2 + args.steps
                    times.setdefault(name, []).append(ms)
                    print(f"batch {batch} {name}: {ms:.3f} ms/step, op calls on the Python path per step "
                          f"{python_calls[0] / args.steps:.1f}", flush=True)
            counters = torch._dynamo.utils.counters
            print(f"batch {batch}: dynamo frames {dict(counters['frames'])} recompiles {dict(counters['recompiles'])}")
            # The sparsity these steps decoded at: the same tokens through the eager model (untimed).
            nnz = decode_sparsity(model, ids[:, :args.prompt], ids[:, args.prompt:], args.device)
            dense = statistics.median(times["dense"])
            for name, values in times.items():
                rows.append((batch, name, statistics.median(values), dense / statistics.median(values), values, nnz))
    tm.twell_mlp = python_path
    print(f"\n{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, {args.layers} layers, "
          f"{args.steps} steps a round, wall ms per step (median of rounds), speed against dense in the same process")
    print(f"{'batch':>5}  {'variant':<18} {'ms/step':>8} {'x dense':>8}  rounds; active units per row while decoding "
          f"(mean / max)")
    for batch, name, ms, ratio, values, (nnz_mean, nnz_max) in rows:
        print(f"{batch:>5}  {name:<18} {ms:>8.3f} {ratio:>7.3f}x  {', '.join(f'{v:.2f}' for v in values)}; "
              f"{nnz_mean:.1f} / {nnz_max}")


if __name__ == "__main__":
    main()
