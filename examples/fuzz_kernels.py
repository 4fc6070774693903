"""Differential fuzzing of the twell ops: random shapes, dtypes, biases, sparsity and kernel settings,
each call checked against a float64 reference.

The CUDA tests run fixed grids of cases. This draws cases from a wider space, so that combinations no
grid names get run too:
- rows from 1 to ``--max-rows``, often near a boundary where the op changes launch or path (the decode
  GEMVs, the cuBLAS range, the sparse kernel's waves, the chunked kernel's threshold);
- the hidden and intermediate sizes of real models (Llama, Qwen, Mistral, OPT) and odd ones, now and
  then an intermediate size past 65536 (indices that do not fit 16 bits);
- bfloat16 and float16, with and without biases, gated and non-gated;
- uniform, very sparse (many empty rows), skewed, dense rows (often the first token), a share of dense
  128-row blocks, half dense, and every tile over capacity;
- x as a 2-D tensor, a 3-D batch, or a strided view;
- the kernels' settings (``twell_mlp.config``): schedules, clusters, K splits, the decode GEMVs, the
  chunked kernel's row threshold lowered so it runs on small calls, the Triton kernels, density
  thresholds that force either path, routing on or off;
- each case calls the op several times on the same weights (routing by density acts from the second
  call on) and, for some cases, replays it from a CUDA graph.

Every output is checked by ``testing.check_output``, as the CUDA tests check theirs: no NaN where the
reference has none, the relative error within 1.5x the dense same-dtype MLP's, and every element within
``testing.elementwise_bound`` of the reference on its row's scale (``testing.worst_element``), which
catches a single wrong row or column of a large call. A setting the op refuses must say so with a twell
error; any other exception is a failure.

Each case is drawn from its own seed, printed before it runs (a CUDA fault ends the process, and the
last line names the case), so any case reruns alone: ``--case-seed N``.

    python examples/fuzz_kernels.py --cases 300 --time-limit 240         # on a GPU
    python examples/fuzz_kernels.py --device cpu --cases 20 --max-rows 64  # the reference path
    python examples/fuzz_kernels.py --focus chunked --cases 100              # only chunked-kernel cases
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile import stats
from twell_compile.kernels import twell_mlp
from twell_compile.testing import check_output, kernel_config, make_problem, problem_references

# (hidden, intermediate) of real models with ReLU-able MLPs, and the 2B shape of the issue.
MODEL_SHAPES = [
    (2048, 5632),    # the 2B Llama of the paper and the benchmarks
    (4096, 11008),   # Llama-2 7B
    (4096, 14336),   # Mistral 7B, Llama-3 8B
    (3584, 18944),   # Qwen2 7B
    (896, 4864),     # Qwen2 0.5B
    (1536, 8960),    # Qwen2 1.5B
    (768, 3072),     # OPT-125m (non-gated, 4x)
    (2560, 10240),   # OPT-2.7B
    (1024, 2816),
]
# Row counts where a launch or a path changes (config defaults, 132-SM waves, tiles of 16/64/128/256).
BOUNDARY_ROWS = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
                 767, 768, 1023, 1024, 1025, 1056, 1057, 1152, 1188, 1189, 2048, 2049, 4095, 4096, 4097,
                 8191, 8192, 16383, 16384, 32767, 32768, 32769]
# Work cap per case (rows x (hidden + intermediate + out)), so that a case takes well under a second.
MAX_WORK = 4e8


@dataclasses.dataclass
class Case:
    seed: int
    m: int
    hidden: int
    intermediate: int
    out_features: int
    dtype: str
    bias: bool
    gated: bool
    sparsity: dict
    layout: str          # "2d", "3d" (x as [2, m/2, hidden]) or "strided" (a view with a row stride)
    config: dict         # twell_mlp.config overrides
    calls: int           # op calls on the same weights (routing acts from the second)
    graph: bool          # also replay the op from a CUDA graph

    def describe(self) -> str:
        return (f"seed={self.seed} m={self.m} K={self.hidden} F={self.intermediate} D={self.out_features} "
                f"{self.dtype} bias={self.bias} gated={self.gated} layout={self.layout} calls={self.calls} "
                f"graph={self.graph} sparsity={self.sparsity} config={self.config}")


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    return max(low, min(high, int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))))


def draw_case(seed: int, max_rows: int, device: str, focus: str = "all") -> Case:
    rng = random.Random(seed)
    gated = rng.random() < 0.7
    # Shape: a real model's, an odd one, or (rarely) an intermediate size past 16-bit indices.
    kind = rng.random()
    if kind < 0.55:
        hidden, intermediate = rng.choice(MODEL_SHAPES)
        out_features = hidden
    elif kind < 0.95:
        hidden = _log_uniform_int(rng, 2, 4200)
        intermediate = _log_uniform_int(rng, 1, 9000)
        out_features = hidden if rng.random() < 0.6 else _log_uniform_int(rng, 1, 4200)
    else:
        hidden, intermediate, out_features = rng.choice([(64, 65537, 64), (40, 70001, 24), (128, 66000, 136)])
    if device == "cpu":  # the reference path: keep it quick
        hidden, intermediate, out_features = min(hidden, 256), min(intermediate, 1024), min(out_features, 256)
    # Rows: a boundary (or next to one), small, or large.
    r = rng.random()
    if r < 0.45:
        m = rng.choice(BOUNDARY_ROWS) + rng.choice([0, 0, 0, -1, 1])
    elif r < 0.8:
        m = _log_uniform_int(rng, 1, 4096)
    else:
        m = _log_uniform_int(rng, 4096, max(4096, max_rows))
    m = max(1, min(m, max_rows, int(MAX_WORK / (hidden + intermediate + out_features))))
    if focus == "chunked":
        # The chunked kernel runs only on large calls by default, which the draw above seldom makes. Here
        # (with its row threshold lowered below) it gets operands the one-call path takes (hidden,
        # intermediate and out_features multiples of 8; contiguous x, below) and an intermediate size
        # whose slices fit its shared memory (about 6200 units).
        if intermediate > 6144:
            intermediate = rng.choice([5632, 4864, 2816, 6144, rng.randint(8, 6144)])
        hidden, intermediate, out_features = (-(-n // 8) * 8 for n in (hidden, intermediate, out_features))
        m = max(1, min(_log_uniform_int(rng, 64, max(64, max_rows)), max_rows,
                       int(MAX_WORK / (hidden + intermediate + out_features))))

    f = intermediate
    mode = rng.choice(["uniform", "uniform", "very_sparse", "skewed", "dense_rows", "dense_blocks", "half_dense",
                       "over_capacity"])
    if mode == "uniform":
        sparsity = dict(nnz_per_row=round(min(f / 3, math.exp(rng.uniform(math.log(0.5), math.log(300)))), 2))
    elif mode == "very_sparse":
        sparsity = dict(nnz_per_row=round(rng.uniform(0.02, 1.0), 3))
    elif mode == "skewed":
        sparsity = dict(nnz_per_row=round(min(f / 3, rng.uniform(8, 100)), 2), skew=True)
    elif mode == "dense_rows":
        rows = sorted({0} | {rng.randrange(m) for _ in range(rng.randint(0, 3))}) if rng.random() < 0.6 else \
            sorted({rng.randrange(m) for _ in range(rng.randint(1, 4))})
        sparsity = dict(nnz_per_row=round(min(f / 3, rng.uniform(4, 60)), 2), dense_rows=tuple(rows))
    elif mode == "dense_blocks":
        sparsity = dict(nnz_per_row=round(min(f / 3, rng.uniform(4, 40)), 2),
                        dense_block_share=round(rng.uniform(0.05, 1.0), 2),
                        dense_block_nnz=round(min(f / 2, f * rng.uniform(0.01, 0.06)), 2),
                        dense_block_placement=rng.choice(["even", "random"]))
    elif mode == "half_dense":
        sparsity = dict(nnz_per_row=f * 0.5)
    else:
        sparsity = dict(nnz_per_row=f * 0.45)

    config = {}
    knobs = [
        ("route_by_density", [True, False]),
        ("cublas_rows", [(1, 0), (33, 512), (1, 10**9)]),
        ("chunked_sparse_rows", [0, 32768, 1, 200, 1024, 4096]),
        ("gate_gemm_tile_m", [128, 256]),
        ("gemm_tile_m", [128, 256]),
        ("down_gemm_tile_m", [128, 256]),
        ("partly_dense_tile_m", [0, 128]),
        ("gemm_cluster", [1, 2]),
        ("gate_pingpong_rows", [None, (1, 0), (1, 10**9)]),
        ("gemm_k_splits", [0, 1, 2, 3, 5]),
        ("decode_gate_rows", [0, 16, 64]),
        ("decode_dense_gemv", [True, False]),
        ("decode_gate_parts", [True, False]),
        ("decode_dense_branch", [True, False]),
        ("decode_gemv_cluster", [0, 1, 2, 4, 8, 16]),
        ("wgmma_kernels", [True, False]),
        ("tma", [True, False]),
        ("dense_block_density", [0.0, 0.003, 0.011, float("inf")]),
        ("chunked_dense_block_density", [0.0, 0.018, float("inf")]),
        ("decode_dense_block_density", [0.0, 0.05, float("inf")]),
        ("heavy_block_overflow_tiles", [0, 16, 2**31 - 1]),
        ("thin_wave_route_density", [0.0, 0.0062, 0.02]),
        ("route_report_every", [1, 32]),
    ]
    share = rng.choice([0.0, 0.1, 0.3])
    for name, values in knobs:
        if rng.random() < share:
            config[name] = rng.choice(values)
    if config.get("cublas_rows", (33, 512)) == (33, 512) and 33 <= m <= 512 and rng.random() < 0.5:
        config["cublas_rows"] = (1, 0)  # half of these calls on the TwELL kernels, not the cuBLAS route
    case = Case(seed=seed, m=m, hidden=hidden, intermediate=intermediate, out_features=out_features,
                dtype=rng.choice(["bfloat16", "bfloat16", "float16"]), bias=rng.random() < 0.5, gated=gated,
                sparsity=sparsity, layout=rng.choice(["2d", "2d", "3d", "strided"]), config=config,
                calls=rng.choice([1, 2, 3]), graph=device == "cuda" and rng.random() < 0.2)
    if focus == "chunked":  # the wgmma kernels, no cuBLAS route, a contiguous x
        case.layout = rng.choice(["2d", "3d"])
        config.update(chunked_sparse_rows=rng.choice([1, max(1, m // 2), m]), cublas_rows=(1, 0), wgmma_kernels=True)
    return case


def _lay_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "3d" and x.shape[0] % 2 == 0:
        return x.reshape(2, x.shape[0] // 2, x.shape[1])
    if layout == "strided":  # every row at a stride of hidden + 8 elements: not contiguous
        # The gap holds NaN on the GPU, so a kernel that reads past a row shows it. On the CPU the op is
        # PyTorch's own matmul, whose oneDNN AMX bf16 kernel multiplies the gap by zero when hidden % 32 != 0
        # (oneDNN issue 5717: 0 * NaN = NaN, in eager too), so there the gap holds a large finite value.
        poison = float("nan") if x.is_cuda else 3e4
        wide = torch.full((x.shape[0], x.shape[1] + 8), poison, dtype=x.dtype, device=x.device)
        wide[:, : x.shape[1]] = x
        return wide[:, : x.shape[1]]
    return x


def launch_kind(case: Case, x: torch.Tensor, device: str) -> str:
    """Which of the op's launches the case's row count and settings pick (the plan of the one-call path;
    routing by density may still send a later call to cuBLAS, which the recorded path shows)."""
    if device != "cuda":
        return "reference"
    plan = twell_mlp.call_plan(case.m, case.intermediate, case.out_features, x.device)
    if plan.cublas:
        return "cublas rows"
    if plan.cuda is None:
        return "general (Triton)"
    # The one-call path takes contiguous x and 16-byte weight and output rows; it declines anything else,
    # and the general path then copies x and runs the gate and the row-by-row kernel (never the chunked one).
    aligned = x.is_contiguous() and case.hidden % 8 == 0 and case.intermediate % 8 == 0 and case.out_features % 8 == 0
    if not aligned:
        gate = "Triton gate" if case.hidden % 8 else "decode" if plan.cuda.decode_gate else "row-by-row"
        return f"{gate}, unaligned"
    return "chunked" if plan.cuda.chunked else "decode" if plan.cuda.decode_gate else "row-by-row"


def check_case(case: Case, device: str) -> tuple[bool, str, dict]:
    """Runs one case; returns (passed, message, measurements)."""
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    problem = make_problem(case.m, case.hidden, case.intermediate, case.out_features, gated=case.gated, bias=case.bias,
                           dtype=dtype, device=device, generator=gen, **case.sparsity)
    args = problem.gated_args() if case.gated else problem.non_gated_args()
    op = torch.ops.twell.gated_relu_mlp if case.gated else torch.ops.twell.relu_mlp
    ref64, dense = problem_references(problem, case.gated)
    x_in = _lay_out(problem.x, case.layout)
    call_args = (x_in, *args[1:])
    info = {"ref_nan": bool(ref64.isnan().any()), "paths": []}

    def judge(out: torch.Tensor, what: str) -> str | None:
        out2 = out.reshape(case.m, case.out_features)
        if tuple(out.shape) != tuple(x_in.shape[:-1]) + (case.out_features,):
            return f"{what}: shape {tuple(out.shape)}, expected {tuple(x_in.shape[:-1]) + (case.out_features,)}"
        if out.dtype != dtype:
            return f"{what}: dtype {out.dtype}"
        if info["ref_nan"]:
            return None  # non-finite references are the NaN tests' business, not this one's
        result = check_output(out2, ref64, dense)
        if not math.isnan(result.err):
            info.setdefault("err", []).append(result.err)
            info.setdefault("worst", []).append(result.worst)
            info["dense_err"], info["dense_worst"] = result.dense_err, result.dense_worst
        return None if result.failure is None else f"{what}: {result.failure}"

    with kernel_config(**{"poison_buffers": True, **case.config}):
        try:
            info["launch"] = launch_kind(case, x_in, device)
            for i in range(case.calls):
                with stats.record_sparsity() as recorder:
                    out = op(*call_args)
                if device == "cuda":
                    torch.cuda.synchronize()
                for c in recorder.calls():
                    dense_note = f", {c.dense_blocks}/{c.blocks} blocks dense" if c.dense_blocks else ""
                    info["paths"].append(f"{c.path}{dense_note}")
                problem_text = judge(out, f"call {i + 1}")
                if problem_text:
                    return False, problem_text, info
            if case.graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    op(*call_args)  # warm-up on a side stream, as torch.cuda.graphs asks
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = op(*call_args)
                for _ in range(2):
                    graph.replay()
                torch.cuda.synchronize()
                problem_text = judge(captured, "graph replay")
                if problem_text:
                    return False, problem_text, info
        except (ValueError, RuntimeError, NotImplementedError) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "CUDA error" in text or "illegal" in text:
                raise  # the context is gone: stop here, the case was printed before it ran
            if "twell" in text.lower():
                info["refused"] = text
                return True, f"refused: {text}", info
            return False, f"{type(e).__name__} without a twell message: {text}", info
    return True, "ok", info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="cases use seeds seed, seed + 1, ...")
    parser.add_argument("--case-seed", type=int, nargs="*", help="run only these cases")
    parser.add_argument("--max-rows", type=int, default=70000)
    parser.add_argument("--time-limit", type=float, default=float("inf"), help="seconds; stops drawing cases after")
    parser.add_argument("--json", help="write every case and its outcome here")
    parser.add_argument("--focus", choices=["all", "chunked"], default="all",
                        help="chunked: every case set up to run the chunked sparse kernel (rerun with the same flag)")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
        from twell_compile.kernels.build import kernels_available

        print(f"twell CUDA kernels: {'built' if kernels_available(torch.device('cuda')) else 'NOT available'}",
              flush=True)
    seeds = args.case_seed if args.case_seed else range(args.seed, args.seed + args.cases)
    start = time.time()
    results, failures, refused = [], [], 0
    coverage: dict[tuple[str, str], int] = {}  # (launch, recorded path) -> cases
    for seed in seeds:
        if time.time() - start > args.time_limit:
            print(f"time limit reached after {len(results)} cases", flush=True)
            break
        case = draw_case(seed, args.max_rows, args.device, args.focus)
        print(f"case {case.describe()}", flush=True)
        t = time.time()
        passed, message, info = check_case(case, args.device)
        refused += message.startswith("refused")
        errs = info.get("err", [])
        print(f"  -> {'PASS' if passed else 'FAIL'} {message} [{info.get('launch')}: {'; '.join(info['paths'])}]"
              + (f" (err {max(errs):.2e}, dense {info['dense_err']:.2e}; worst element {max(info['worst']):.2e},"
                 f" dense {info['dense_worst']:.2e})" if errs else "") + f" [{time.time() - t:.2f} s]", flush=True)
        paths = {p.split(",")[0] + (", some blocks dense" if "dense" in p else "") for p in info["paths"]}
        for p in sorted(paths) or ["(no call completed)"]:
            coverage[(info.get("launch", "?"), p)] = coverage.get((info.get("launch", "?"), p), 0) + 1
        results.append({"case": dataclasses.asdict(case), "passed": passed, "message": message,
                        **{k: v for k, v in info.items() if k != "refused"}})
        if not passed:
            failures.append((case, message))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    print("\ncases by launch and recorded path (a case with calls on two paths counts under both):")
    for (launch, path), n in sorted(coverage.items()):
        print(f"  {launch:<28} {path:<32} {n:>5}")
    print(f"\n{len(results)} cases in {time.time() - start:.0f} s: {len(results) - len(failures)} passed "
          f"({refused} refused with a twell error), {len(failures)} failed")
    for case, message in failures:
        focus = "" if args.focus == "all" else f" --focus {args.focus}"
        print(f"FAILED --case-seed {case.seed}{focus}: {message}\n    {case.describe()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
