"""Cache of the transposed down-projection weight the sparse kernel reads row by row.

An entry is valid only while the source tensor's storage is alive and its version counter unchanged
(any in-place update, e.g. an optimizer step, bumps it), so a freed weight whose address is reused by
another model never hits a stale entry. Nothing is keyed by layer numbers.

CUDA graphs: while a graph is captured nothing is cached (the copy is recorded into the graph and
replayed with it). Cudagraph trees also run a warm-up with this thread's allocations routed to their
private pool, which must hold nothing but tracked outputs afterwards; so an entry's storage is
allocated from a short-lived helper thread (default pool) and only filled on the current stream.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_MAX_ENTRIES = 1024


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter: never cache them
        return None


def _empty_outside_graph_pools(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    if not like.is_cuda:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    result: list[torch.Tensor] = []
    helper = threading.Thread(target=lambda: result.append(torch.empty(shape, dtype=like.dtype, device=like.device)))
    helper.start()
    helper.join()
    # Allocated on the helper's (default) stream, used on ours: tell the allocator before it is reused.
    result[0].record_stream(torch.cuda.current_stream(like.device))
    return result[0]


class TransposedWeightCache:
    def __init__(self, max_entries: int = _MAX_ENTRIES):
        self._entries: OrderedDict[tuple, tuple[StorageWeakRef, int, torch.Tensor]] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def transposed(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight.t().contiguous()``, computed once per weight version."""
        version = _version(weight)
        if version is None:
            return weight.t().contiguous()
        key = (weight.data_ptr(), weight.device, weight.dtype, tuple(weight.shape), tuple(weight.stride()))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                ref, cached_version, transposed = entry
                if not ref.expired() and cached_version == version:
                    self._entries.move_to_end(key)
                    return transposed
                del self._entries[key]
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return weight.t().contiguous()
        transposed = _empty_outside_graph_pools((weight.shape[1], weight.shape[0]), weight)
        transposed.copy_(weight.t())
        with self._lock:
            self._entries[key] = (StorageWeakRef(weight.untyped_storage()), version, transposed)
            for stale in [k for k, (ref, _, _) in self._entries.items() if ref.expired()]:
                del self._entries[stale]
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return transposed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


DOWN_WEIGHT_T = TransposedWeightCache()
