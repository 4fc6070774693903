"""Synthetic ReLU-sparse MLP problems with controlled activation density (tests and benchmarks).

The gate pre-activation of token ``r`` and unit ``u`` is ``z - shift[r] - unit_shift[u]`` with
``z ~ N(0, 1)`` from random x and weights. The shifts ride on x's first feature (x[:, 0] = shift and
W_gate[:, 0] = -1 - unit_shift), so the data looks like real activations to the kernels: no bias is
needed, nothing is all-zero, and the density of each token and unit is set exactly in expectation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import Tensor

from . import reference
from .kernels.triton_kernels import DECISION_ROWS  # the kernels' dense-or-sparse blocks


@contextlib.contextmanager
def kernel_config(**overrides):
    """``twell_mlp.config`` with these fields set for the block, restored after it, whatever happens."""
    from .kernels import twell_mlp

    saved = {k: getattr(twell_mlp.config, k) for k in overrides}
    for k, v in overrides.items():
        setattr(twell_mlp.config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(twell_mlp.config, k, v)


@dataclasses.dataclass
class MlpProblem:
    x: Tensor
    gate_weight: Tensor | None
    up_weight: Tensor
    down_weight: Tensor
    gate_bias: Tensor | None
    up_bias: Tensor | None
    down_bias: Tensor | None

    def gated_args(self):
        return (self.x, self.gate_weight, self.up_weight, self.down_weight, self.gate_bias, self.up_bias, self.down_bias)

    def non_gated_args(self):
        return (self.x, self.up_weight, self.down_weight, self.up_bias, self.down_bias)


def _normal_quantile(p: float) -> float:
    """z with P(N(0,1) > z) = p."""
    return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(1.0 - 2.0 * p, dtype=torch.float64)).item()


def _density_shift(nnz_per_row: float, intermediate: int) -> float:
    """The row shift (x[:, 0]) that leaves about ``nnz_per_row`` of ``intermediate`` units active."""
    return _normal_quantile(min(max(nnz_per_row / intermediate, 1e-6), 0.999))


def make_problem(
    m: int, hidden: int, intermediate: int, out_features: int | None = None, *,
    nnz_per_row: float = 24.0, gated: bool = True, bias: bool = False, skew: bool = False,
    dense_rows: tuple[int, ...] = (), dense_block_share: float = 0.0, dense_block_nnz: float = 80.0,
    dense_block_placement: str = "even", dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
    generator: torch.Generator | None = None,
) -> MlpProblem:
    """Random MLP inputs whose ReLU activation has about ``nnz_per_row`` active units per token.

    ``skew``: per-token and per-unit variation (a random shift per token, 2% heavy units, 0.5% heavy
    tokens with hundreds to thousands of active units), so some tiles overflow any fixed capacity.
    ``dense_rows``: tokens with every unit active.
    ``dense_block_share``: that share of the 128-row blocks (the kernels' decision blocks) has
    ``dense_block_nnz`` active units per row instead (80 is past every dense-block threshold at the 2B
    shape), spread evenly over the rows (``dense_block_placement="even"``) or drawn at random
    (``"random"``; even spacing is close to the worst case for the dense-path GEMMs' persistent walk,
    examples/simulate_dense_walk.py).
    The activated projection is the gate (gated) or the up projection (non-gated).
    """
    if hidden < 2:
        raise ValueError("hidden must be at least 2 (x[:, 0] carries the density shift)")
    out_features = hidden if out_features is None else out_features
    g = generator
    # Work in float64 on the CPU, float32 on a GPU (fast enough for 131072-token problems).
    work_dtype = torch.float64 if torch.device(device).type == "cpu" else torch.float32
    f64 = dict(dtype=work_dtype, device=device)
    row_shift = torch.full((m,), _density_shift(nnz_per_row, intermediate), **f64)
    unit_shift = torch.zeros(intermediate, **f64)
    if skew:
        row_shift = row_shift + 0.3 * torch.randn(m, generator=g, **f64)
        heavy_rows = torch.rand(m, generator=g, **f64) < 0.005
        row_shift[heavy_rows] -= 2.0
        heavy_units = torch.rand(intermediate, generator=g, **f64) < 0.02
        unit_shift[heavy_units] -= 1.0
    blocks = -(-m // DECISION_ROWS)
    n_dense = round(dense_block_share * blocks)
    if dense_block_placement == "even":
        dense_blocks = sorted({i * blocks // n_dense for i in range(n_dense)}) if n_dense else []
    elif dense_block_placement == "random":
        order = torch.randperm(blocks, generator=g, device=g.device if g is not None else "cpu")
        dense_blocks = sorted(order[:n_dense].tolist())
    else:
        raise ValueError(f"dense_block_placement is 'even' or 'random', not {dense_block_placement!r}")
    for b in dense_blocks:
        row_shift[b * DECISION_ROWS:(b + 1) * DECISION_ROWS] = _density_shift(dense_block_nnz, intermediate)
    for r in dense_rows:
        if r < m:
            row_shift[r] = -12.0

    x = torch.randn(m, hidden, generator=g, **f64)
    x[:, 0] = row_shift
    act = torch.randn(intermediate, hidden, generator=g, **f64) / math.sqrt(hidden - 1)
    act[:, 0] = 1.0 + unit_shift
    # z = x[:, 1:] . act[:, 1:] ~ N(0, 1); pre-activation = z - row_shift * (1 + unit_shift) -> flip sign of
    # column 0. (A heavy unit, unit_shift -1, thus ignores the row's shift: active on about half of all rows.)
    act[:, 0] = -act[:, 0]
    other = torch.randn(intermediate, hidden, generator=g, **f64) / math.sqrt(hidden)
    down = torch.randn(out_features, intermediate, generator=g, **f64) / math.sqrt(max(nnz_per_row, 1.0))

    def cast(t):
        return t.to(device=device, dtype=dtype)

    def small(n):
        return cast(0.05 * torch.randn(n, generator=g, **f64)) if bias else None

    if gated:
        return MlpProblem(cast(x), cast(act), cast(other), cast(down), small(intermediate), small(intermediate),
                          small(out_features))
    return MlpProblem(cast(x), None, cast(act), cast(down), None, small(intermediate), small(out_features))


def cuda_time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_graph_time_ms(fn, reps: int, calls: int = 1) -> float:
    """Median time of replaying a CUDA graph of ``calls`` calls of ``fn()``, per call: the kernels without
    their host launches. Each replay is timed alone and waited for, so it also holds the host's launch of
    the graph (3-5 us of a decode-sized call's time on an H100 host, 2026-11-28; an empty graph's replay
    took 17-19 us); ``calls`` > 1 spreads that over as many calls, as a model captured whole does over
    its layers."""
    if calls < 1:
        raise ValueError("calls must be at least 1")
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, reps) / calls


def marked_block_nnz(m: int, dense_blocks, device: str | torch.device = "cuda") -> Tensor:
    """Block counts (``block_nnz``, int32 [2 * ceil(m / 128)]) that the dense path's kernels, under
    thresholds (0, 0, INT32_MAX), read as exactly ``dense_blocks`` dense: for driving
    ``dense_block_gemm`` without a gate."""
    nnz = torch.zeros(2 * -(-m // DECISION_ROWS), dtype=torch.int32, device=device)
    nnz[list(dense_blocks)] = 1
    return nnz


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (NaN if anything is NaN)."""
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def _normalized_errors(actual: Tensor, expected: Tensor) -> Tensor:
    """|actual - expected| / (|expected| + the row's RMS of expected), in float64: an element's error on
    the scale of its row, so that elements near zero are not held to a relative bound they cannot meet
    and rows whose reference is all zeros must come out (nearly) zero."""
    a, e = actual.double(), expected.double()
    e2 = e.reshape(-1, e.shape[-1]) if e.dim() > 0 else e.reshape(1, 1)
    a2 = a.reshape(e2.shape)
    row_rms = e2.pow(2).mean(dim=1, keepdim=True).sqrt()
    floor = 1e-6 * e2.pow(2).mean().sqrt().clamp_min(1e-30)  # rows of zeros: on the output's scale
    return (a2 - e2).abs() / (e2.abs() + row_rms + floor)


def worst_element(actual: Tensor, expected: Tensor, dense_same_dtype: Tensor) -> tuple[float, float, tuple[int, int]]:
    """The largest element error on its row's scale (``_normalized_errors``) of ``actual`` and of the
    dense MLP in the same dtype, against the float64 ``expected``, and where ``actual``'s is (row, column).

    A relative Frobenius norm over a whole call hides a few wrong rows in a large one (one garbage row of
    131072 moves it by about 0.3%); this does not. NaN where anything is NaN."""
    if actual.numel() == 0:
        return 0.0, 0.0, (0, 0)
    ours = _normalized_errors(actual, expected)
    dense = _normalized_errors(dense_same_dtype, expected)
    flat = int(torch.nan_to_num(ours, nan=float("inf")).argmax())
    where = divmod(flat, ours.shape[1])
    return ours.max().item(), dense.max().item(), where  # max() is NaN where any element is


def elementwise_bound(dense_worst: float, dtype: torch.dtype) -> float:
    """How large ``worst_element`` may be for a kernel: 4x the dense same-dtype MLP's worst element, plus
    twice the dtype's rounding unit (a kernel sums in another order, and rounds h and the output once
    each, as eager does)."""
    return 4.0 * dense_worst + 2.0 * torch.finfo(dtype).eps


def problem_references(problem: MlpProblem, gated: bool = True) -> tuple[Tensor, Tensor]:
    """(the float64 reference, the dense MLP in the problem's own dtype) of the op call on ``problem``:
    what a kernel's output is judged against, and by (``check_output``)."""
    mlp = reference.gated_relu_mlp if gated else reference.relu_mlp
    args = problem.gated_args() if gated else problem.non_gated_args()
    return mlp(*[None if t is None else t.double() for t in args]), mlp(*args)


@dataclasses.dataclass
class OutputCheck:
    """``check_output``'s measurements, and the first bound broken (None: the output passes)."""

    err: float
    dense_err: float
    worst: float
    dense_worst: float
    failure: str | None


def check_output(out: Tensor, ref64: Tensor, dense_same_dtype: Tensor) -> OutputCheck:
    """A kernel's output against the float64 reference, as the CUDA tests and the fuzzer require it: no
    NaN (unwritten elements or a bad read), a relative error within 1.5x the dense same-dtype MLP's, and
    every element within ``elementwise_bound`` on its row's scale (the norm over a large call hides a few
    wrong rows or columns)."""
    if out.isnan().any():
        rows = out.reshape(-1, out.shape[-1]).isnan().any(dim=1).nonzero().flatten()[:8].tolist()
        nan = float("nan")
        return OutputCheck(nan, nan, nan, nan, f"NaN in rows {rows} (unwritten elements or a bad read)")
    err, dense_err = relative_error(out, ref64), relative_error(dense_same_dtype, ref64)
    worst, dense_worst, (row, col) = worst_element(out, ref64, dense_same_dtype)
    failure = None
    if not err <= 1.5 * dense_err + 1e-4:
        failure = f"relative error {err:.2e} vs dense {dense_err:.2e}"
    elif not worst <= (bound := elementwise_bound(dense_worst, out.dtype)):
        failure = (f"element ({row}, {col}) off by {worst:.2e} of its row's scale, "
                   f"dense same-dtype at most {dense_worst:.2e} (bound {bound:.2e})")
    return OutputCheck(err, dense_err, worst, dense_worst, failure)
