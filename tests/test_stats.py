"""record_sparsity on the CPU: what the reference path records, the table, and the path names."""

from __future__ import annotations

import pytest
import torch

import twell_compile
from twell_compile import stats
from twell_compile.testing import make_problem


def test_reference_path_records_its_activation_and_path():
    problem = make_problem(40, 64, 256, 48, nnz_per_row=20.0, dtype=torch.float32, device="cpu", dense_rows=(3,))
    torch.ops.twell.gated_relu_mlp(*problem.gated_args())  # outside a recorder: nothing kept
    with twell_compile.record_sparsity() as rec:
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        torch.ops.twell.relu_mlp(*problem.non_gated_args())
    gated, non_gated = rec.calls()
    pre = problem.x @ problem.gate_weight.t()
    assert (gated.op, gated.rows, gated.width, gated.path) == ("gated_relu_mlp", 40, 256, "reference")
    assert gated.max_nnz_per_row == 256  # the dense row
    assert gated.mean_nnz_per_row == pytest.approx((pre > 0).sum(1).double().mean().item())
    # Only the TwELL kernels decide blocks and capacity: the reference leaves those None.
    assert (gated.overflow_rows, gated.dense_blocks, gated.blocks) == (None, None, None)
    assert (non_gated.op, non_gated.path) == ("relu_mlp", "reference")
    header, *rows = rec.table().splitlines()
    assert header.split()[-1] == "path" and len(rows) == 2
    assert rows[0].split()[-1] == "reference" and rows[0].split()[-3:-1] == ["-", "-"]


def test_calls_captured_in_a_cuda_graph_are_not_recorded(monkeypatch):
    # Under capture the kernels have not run, so there is nothing true to record; a stand-in for the
    # capture state, on the CPU (the ops' CUDA path asks stats.active_recorder() the same way).
    problem = make_problem(8, 16, 32, nnz_per_row=4.0, dtype=torch.float32, device="cpu")
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with twell_compile.record_sparsity() as rec:
        assert stats.active_recorder() is None
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        capturing[0] = False
        assert stats.active_recorder() is rec
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    assert len(rec.calls()) == 1


def test_nested_recorders_each_see_every_call_and_threads_their_own():
    import threading

    problem = make_problem(8, 16, 32, nnz_per_row=4.0, dtype=torch.float32, device="cpu")
    other = make_problem(5, 16, 32, nnz_per_row=4.0, dtype=torch.float32, device="cpu")
    with twell_compile.record_sparsity() as outer:
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        with twell_compile.record_sparsity() as inner:
            torch.ops.twell.gated_relu_mlp(*other.gated_args())
            # another thread's call is its own, not these recorders'
            thread = threading.Thread(target=lambda: torch.ops.twell.gated_relu_mlp(*problem.gated_args()))
            thread.start()
            thread.join()
    assert [c.rows for c in outer.calls()] == [8, 5]
    assert [c.rows for c in inner.calls()] == [5]
    assert inner.calls()[0] == outer.calls()[1]


def test_asyncio_tasks_record_apart():
    """Two requests served as asyncio tasks of one thread: each recorder sees its own task's calls (a
    thread-local list would give each both)."""
    import asyncio

    def problem(rows):
        return make_problem(rows, 16, 32, nnz_per_row=4.0, dtype=torch.float32, device="cpu")

    async def request(rows, other_started, started):
        with twell_compile.record_sparsity() as rec:
            started.set()
            await other_started.wait()  # both recorders active at once
            torch.ops.twell.gated_relu_mlp(*problem(rows).gated_args())
            await asyncio.sleep(0)
            return [c.rows for c in rec.calls()]

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(request(3, b, a), request(7, a, b))

    assert asyncio.run(main()) == [[3], [7]]


def test_one_read_gives_every_count():
    recorder = stats.SparsityRecorder()
    recorder.add("gated_relu_mlp", torch.tensor([3, 5, 0], dtype=torch.int32), 64,
                 overflow_rows=torch.tensor([True, False, True]), block_dense=torch.tensor([False, True]), path="twell")
    recorder.add("relu_mlp", torch.tensor([], dtype=torch.int32), 64, overflow_rows=torch.tensor([], dtype=torch.bool),
                 path="twell")
    recorder.add("relu_mlp", torch.tensor([7]), 64, path="reference")
    first, empty, reference = recorder.calls()
    assert (first.mean_nnz_per_row, first.max_nnz_per_row, first.overflow_rows, first.dense_blocks, first.blocks) == (
        8 / 3, 5, 2, 1, 2)
    assert (empty.rows, empty.max_nnz_per_row, empty.overflow_rows, empty.dense_blocks) == (0, 0, 0, None)
    assert (reference.max_nnz_per_row, reference.overflow_rows, reference.dense_blocks) == (7, None, None)


def test_path_names_are_checked():
    recorder = stats.SparsityRecorder()
    recorder.add("relu_mlp", torch.tensor([1, 2]), 8, path="cublas")
    assert recorder.calls()[0].path == "cublas"
    with pytest.raises(ValueError, match="unknown path 'dense'"):
        recorder.add("relu_mlp", torch.tensor([1]), 8, path="dense")


def test_make_problem_puts_its_dense_blocks_where_asked():
    """The benchmarks' and routing tests' partly dense activations: a share of the 128-row blocks, spread
    evenly, at dense_block_nnz active units per row; the rest at nnz_per_row."""
    problem = make_problem(1024, 256, 1024, nnz_per_row=8.0, dense_block_share=0.25, dense_block_nnz=200.0,
                           dtype=torch.float64, device="cpu")
    pre = problem.x @ problem.gate_weight.t()
    per_block = stats.active_units(pre).view(8, 128, -1).sum(-1).double().mean(1)
    dense = (per_block > 50).nonzero().flatten().tolist()
    assert dense == [0, 4]
    assert per_block[dense].min() > 150 and per_block.max() < 250 and per_block[[1, 2, 3, 5, 6, 7]].max() < 16


def test_make_problem_can_draw_its_dense_blocks_at_random():
    kwargs = dict(nnz_per_row=8.0, dense_block_share=0.25, dense_block_nnz=200.0, dtype=torch.float64, device="cpu")
    problem = make_problem(2048, 256, 1024, dense_block_placement="random", generator=torch.Generator().manual_seed(3),
                           **kwargs)
    per_block = stats.active_units(problem.x @ problem.gate_weight.t()).view(16, 128, -1).sum(-1).double().mean(1)
    dense = (per_block > 50).nonzero().flatten().tolist()
    assert len(dense) == 4 and dense != [0, 4, 8, 12]
    with pytest.raises(ValueError, match="dense_block_placement"):
        make_problem(256, 64, 96, dense_block_placement="spread", **kwargs)
