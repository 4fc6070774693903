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
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

_ACTIVE: list["SparsityRecorder"] = []
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
        self._pending: list[tuple[str, int, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int | None,
                                  str]] = []

    def add(self, op: str, nnz_per_row: torch.Tensor, width: int, overflow_rows: torch.Tensor | None = None,
            block_dense: torch.Tensor | None = None, *, path: str) -> None:
        if path not in PATHS:
            raise ValueError(f"twell: unknown path {path!r} (expected one of {', '.join(PATHS)})")
        rows = nnz_per_row.numel()
        packed = torch.stack([nnz_per_row.sum(dtype=torch.int64), nnz_per_row.max().to(torch.int64)]) if rows else None
        self._pending.append((
            op, rows, width, packed,
            None if overflow_rows is None else overflow_rows.sum(dtype=torch.int64),
            None if block_dense is None else block_dense.sum(dtype=torch.int64),
            None if block_dense is None else block_dense.numel(),
            path,
        ))

    def calls(self) -> list[CallStats]:
        """One entry per recorded op call, in call order (reads the device tensors: syncs once)."""
        out = []
        for op, rows, width, packed, overflow, dense, blocks, path in self._pending:
            total, most = packed.tolist() if packed is not None else (0, 0)
            out.append(CallStats(op, rows, width, total / max(rows, 1), most,
                                 None if overflow is None else int(overflow),
                                 None if dense is None else int(dense), blocks, path))
        return out

    def table(self) -> str:
        lines = [f"{'call':>4} {'op':<15} {'rows':>8} {'width':>6} {'mean nnz/row':>12} {'max nnz/row':>11} "
                 f"{'overflow rows':>13} {'dense blocks':>12} {'path':<9}"]
        for i, c in enumerate(self.calls()):
            overflow = "-" if c.overflow_rows is None else str(c.overflow_rows)
            dense = "-" if c.dense_blocks is None else f"{c.dense_blocks}/{c.blocks}"
            lines.append(f"{i:>4} {c.op:<15} {c.rows:>8} {c.width:>6} {c.mean_nnz_per_row:>12.2f} "
                         f"{c.max_nnz_per_row:>11} {overflow:>13} {dense:>12} {c.path:<9}".rstrip())
        return "\n".join(lines)


@contextlib.contextmanager
def record_sparsity():
    recorder = SparsityRecorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


def active_recorder() -> SparsityRecorder | None:
    """The innermost recorder, if any, unless the current CUDA stream is being captured (see above)."""
    if not _ACTIVE:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return _ACTIVE[-1]
