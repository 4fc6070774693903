"""Where a decode step's host time goes without CUDA graphs (``torch.compile``'s default mode): the
2B-shape ReLU Llama decoding from a static cache, dense ``torch.compile`` against ``backend="twell"``.

For each batch and backend: wall ms per step over ``--steps`` steps after warm-up (synced at the end;
without graphs the host paces a decode step), the frames and recompilations Dynamo counted, how many
of the op's calls per step went to cuBLAS (``_cublas_mlp``), took the step-by-step general path
(``_twell_mlp_general``) or made a density report (``block_dense``; the rest took the one-call path),
the density router's state, then cProfile's top functions by own time over ``--steps`` more steps.
cProfile times a C++ builtin's call whole (its launches included) and adds its own cost to every
Python call: compare functions within one profile, and processes by their wall times.

    python examples/profile_decode_host.py --batch 1 8 --steps 16
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time

import torch

from bench_decode import add_model_arguments, prefilled_decoder
from bench_model import build_model


def count_calls(module, names, counts):
    """Wraps ``module.<name>`` to count its calls (the originals are returned to undo it)."""
    originals = {}
    for name in names:
        fn = getattr(module, name)
        originals[name] = fn

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapped)
    return originals


def router_summary(router) -> str:
    """Layers the density router tracks, per size class: how many have reports read, their mean
    dense-block share, and how many route to cuBLAS now."""
    classes: dict[str, list] = {}
    for layer in router._layers.values():
        for name, state in layer.classes.items():
            classes.setdefault(name, []).append(state)
    parts = [f"{len(router)} layers"]
    for name, states in sorted(classes.items()):
        shares = [s.share for s in states if s.share is not None]
        mean = f"{sum(shares) / len(shares):.3f}" if shares else "none"
        parts.append(f"{name}: {len(shares)}/{len(states)} with reports, mean share {mean}, "
                     f"{sum(s.cublas for s in states)} on cuBLAS")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--top", type=int, default=30, help="functions cProfile lists (0: no profile)")
    add_model_arguments(parser)
    args = parser.parse_args()

    import twell_compile  # noqa: F401  (registers backend="twell")
    from twell_compile.kernels import twell_mlp as tm
    from twell_compile.kernels.density_route import ROUTER

    torch.manual_seed(0)
    model = build_model(args.layers, args.nnz, max(args.prompt, 64), args.device, args.hidden, args.intermediate, args.heads, args.vocab)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(torch.cuda.get_device_name() if args.device == "cuda" else "CPU", flush=True)
    with torch.inference_mode():
        for batch in args.batch:
            for backend in ("inductor", "twell"):
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                step = torch.compile(model.model, backend=backend)
                ids = torch.randint(0, args.vocab, (batch, args.prompt + args.warmup + 2 * args.steps),
                                    device=args.device)
                steps_run = prefilled_decoder(model, step, ids[:, :args.prompt], ids[:, args.prompt:], args.device)
                fed = 0

                def run(count):
                    nonlocal fed
                    steps_run(fed, count)
                    fed += count

                run(args.warmup)
                sync()
                counts = collections.Counter()
                # block_dense runs once per reporting call of the TwELL path (and for the stats recorder)
                originals = count_calls(tm, ["_cublas_mlp", "_twell_mlp_general", "block_dense"], counts)
                began = time.perf_counter()
                run(args.steps)
                sync()
                ms = (time.perf_counter() - began) * 1e3 / args.steps  # wall time: the host paces these steps
                for name, fn in originals.items():
                    setattr(tm, name, fn)
                profiler = None
                if args.top > 0:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    run(args.steps)
                    sync()
                    profiler.disable()
                frames = dict(torch._dynamo.utils.counters["frames"])
                recompiles = dict(torch._dynamo.utils.counters["recompiles"])
                print(f"\n=== batch {batch} {backend}: {ms:.3f} ms/step; dynamo frames {frames} recompiles {recompiles}; "
                      f"per step: {', '.join(f'{k} {v / args.steps:.1f}' for k, v in counts.items()) or 'none'} "
                      f"(of _cublas_mlp, _twell_mlp_general, block_dense)",
                      flush=True)
                if backend == "twell":
                    print(f"router: {router_summary(ROUTER)}")
                if profiler is not None:
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
                    print("\n".join(text.getvalue().splitlines()[:args.top + 12]), flush=True)


if __name__ == "__main__":
    main()
