"""Per-layer sparsity statistics, recorded on request without host syncs in the hot path.

    with twell_compile.record_sparsity() as rec:
        model(inputs)
    print(rec.table())

While a recorder is active, every twell op call appends device tensors (active units per row, rows
that overflowed a tile's capacity, 128-row blocks that took the dense path) and which path ran it
(``twell``: the TwELL kernels; ``cublas``: the dense MLP through cuBLAS, which calls of some sizes take
whatever their activation, and layers whose earlier calls were mostly dense, kernels/density_route.py;
``reference``: the plain-PyTorch path of CPUs, float32 and GPUs without
the kernels). The tensors are read back only when the summary is asked for. Calls are numbered in
execution order, which for a compiled model is layer order. Kernels replayed from a CUDA graph run no
Python, so nothing is recorded for them: record with ``mode="default"``. Nor is a call made while a CUDA
graph is being captured (``mode="reduce-overhead"``'s recording call): its kernels have not run yet, so
its statistics would be whatever the memory held, and the reductions would join the graph's every replay.
A recorder sees the calls its own thread makes (its own asyncio task, and the tasks started inside
it), and nested recorders each see every call made inside them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch

# The recorders of this context (thread, or asyncio task: a task starts with its creator's), outermost
# first. A context variable rather than a thread-local: two requests served as tasks of one thread
# record apart.
_ACTIVE: contextvars.ContextVar[tuple["SparsityRecorder", ...]] = contextvars.ContextVar("twell_recorders", default=())
PATHS = ("twell", "cublas", "reference")


def active_units(pre_activation: torch.Tensor) -> torch.Tensor:
    """Which units a ReLU keeps active: positive, or NaN (which eager's relu propagates), as the kernels'
    is_active (csrc/dtype16.cuh) counts them."""
    return (pre_activation > 0) | pre_activation.isnan()


@dataclasses.dataclass
class CallStats:
    op: str
    rows: int
    width: int
    mean_nnz_per_row: float
    max_nnz_per_row: int
    overflow_rows: int | None
    dense_blocks: int | None
    blocks: int | None
    path: str  # "twell", "cublas" or "reference" (see the module docstring)


class SparsityRecorder:
    def __init__(self) -> None:
        # (op, rows, width, sums on the device or None for no rows, overflow known, dense blocks known,
        # blocks, path): see _summary
        self._pending: list[tuple[str, int, int, torch.Tensor | None, bool, bool, int | None, str]] = []

    def add(self, op: str, nnz_per_row: torch.Tensor, width: int, overflow_rows: torch.Tensor | None = None,
            block_dense: torch.Tensor | None = None, *, path: str) -> None:
        self._pending.append(_summary(op, nnz_per_row, width, overflow_rows, block_dense, path))

    def calls(self) -> list[CallStats]:
        """One entry per recorded op call, in call order (reads the device tensors: one copy per device)."""
        # Every call's sums on one device in one tensor, read back at once.
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, _, packed, _, _, _, _ in self._pending:
            if packed is not None:
                by_device.setdefault(packed.device, []).append(packed)
        values = {device: iter(torch.stack(parts).tolist()) for device, parts in by_device.items()}
        out = []
        for op, rows, width, packed, has_overflow, has_dense, blocks, path in self._pending:
            total, most, overflow, dense = next(values[packed.device]) if packed is not None else (0, 0, 0, 0)
            out.append(CallStats(op, rows, width, total / max(rows, 1), most, overflow if has_overflow else None,
                                 dense if has_dense else None, blocks, path))
        return out

    def table(self) -> str:
        lines = [f"{'call':>4} {'op':<15} {'rows':>8} {'width':>6} {'mean nnz/row':>12} {'max nnz/row':>11} "
                 f"{'overflow rows':>13} {'dense blocks':>12} {'path'}"]
        for i, c in enumerate(self.calls()):
            overflow = "-" if c.overflow_rows is None else str(c.overflow_rows)
            dense = "-" if c.dense_blocks is None else f"{c.dense_blocks}/{c.blocks}"
            lines.append(f"{i:>4} {c.op:<15} {c.rows:>8} {c.width:>6} {c.mean_nnz_per_row:>12.2f} "
                         f"{c.max_nnz_per_row:>11} {overflow:>13} {dense:>12} {c.path:<9}".rstrip())
        return "\n".join(lines)


def _summary(op: str, nnz_per_row: torch.Tensor, width: int, overflow_rows: torch.Tensor | None,
             block_dense: torch.Tensor | None, path: str) -> tuple:
    """A call's entry: its sums as one int64 device tensor (total and max active units per row, rows
    past a tile's capacity, dense blocks; 0 where not known), reduced on the device, read later."""
    if path not in PATHS:
        raise ValueError(f"twell: unknown path {path!r} (expected one of {', '.join(PATHS)})")
    rows = nnz_per_row.numel()
    packed = None
    if rows:
        unknown = nnz_per_row.new_zeros((), dtype=torch.int64)
        packed = torch.stack([
            nnz_per_row.sum(dtype=torch.int64), nnz_per_row.max().to(torch.int64),
            unknown if overflow_rows is None else overflow_rows.sum(dtype=torch.int64).to(unknown.device),
            unknown if block_dense is None else block_dense.sum(dtype=torch.int64).to(unknown.device),
        ])
    return (op, rows, width, packed, overflow_rows is not None, block_dense is not None,
            None if block_dense is None else block_dense.numel(), path)


class _Recorders:
    """Nested recorders, each to get every call: the call is reduced once."""

    def __init__(self, recorders: list[SparsityRecorder]):
        self._recorders = recorders

    def add(self, op: str, nnz_per_row: torch.Tensor, width: int, overflow_rows: torch.Tensor | None = None,
            block_dense: torch.Tensor | None = None, *, path: str) -> None:
        entry = _summary(op, nnz_per_row, width, overflow_rows, block_dense, path)
        for recorder in self._recorders:
            recorder._pending.append(entry)


@contextlib.contextmanager
def record_sparsity():
    recorder = SparsityRecorder()
    token = _ACTIVE.set((*_ACTIVE.get(), recorder))
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


def active_recorder() -> SparsityRecorder | _Recorders | None:
    """What to give this context's op calls to: its recorder, or all of its nested recorders; None when
    it has none, or while the current CUDA stream is being captured (see above)."""
    active = _ACTIVE.get()
    if not active:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return active[0] if len(active) == 1 else _Recorders(list(active))
