"""Caches of weights in the layouts the sparse kernels read: the down projection transposed (the
row-by-row kernel reads it a unit's row at a time), and W_up and W_down^T sliced into blocks of 8
columns of every unit (the chunked kernel streams one such slice at a time through shared memory).

An entry is valid only while the source tensor's storage is alive and its version counter unchanged
(any in-place update, e.g. an optimizer step, bumps it), so a freed weight whose address is reused by
another model never hits a stale entry. Nothing is keyed by layer numbers.

Streams: an entry is filled on the stream of the call that made it. A call on another stream (two
requests served on two streams, say) that finds it waits for that fill on the device (an event, no host
sync) and is recorded with the allocator as a user of its memory; calls on the filling stream, the usual
case, are ordered already and pay only a comparison of stream handles.

CUDA graphs: while a graph is captured nothing is cached (the copy is recorded into the graph and
replayed with it). Cudagraph trees also run a warm-up with this thread's allocations routed to their
private pool, which must hold nothing but tracked outputs afterwards; so an entry's storage is
allocated from a short-lived helper thread (default pool) and only filled on the current stream.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import leases

_MAX_ENTRIES = 1024


_INFERENCE_WEIGHT_WARNING = (
    "twell: a weight is an inference tensor (created under torch.inference_mode()), which carries no "
    "version counter, so its re-laid copy for the sparse kernels cannot be cached safely and is rebuilt on "
    "every call (a copy of the whole weight each time). Create or load the model outside "
    "torch.inference_mode() (running it inside is fine) to have it cached.")
_warned_inference_weight = False


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter: never cache them
        global _warned_inference_weight
        if not _warned_inference_weight:
            _warned_inference_weight = True
            warnings.warn(_INFERENCE_WEIGHT_WARNING, RuntimeWarning, stacklevel=2)
        return None


def _empty_outside_graph_pools(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if not like.is_cuda:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    result: list[torch.Tensor] = []
    helper = threading.Thread(target=lambda: result.append(torch.empty(shape, dtype=like.dtype, device=like.device)))
    helper.start()
    helper.join()
    # Allocated on the helper's (default) stream, used on ours: tell the allocator before it is reused.
    result[0].record_stream(torch.cuda.current_stream(like.device))
    return result[0]


def weight_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight to the caches (and to density_route.py) while its storage is alive."""
    # (torch.Size is a tuple and stride() returns one: no conversions, this runs several times a call)
    return (weight.data_ptr(), weight.device, weight.dtype, weight.shape, weight.stride())


def _transpose(weight: torch.Tensor) -> torch.Tensor:
    return weight.t()


def _slice_rows(weight: torch.Tensor) -> torch.Tensor:
    """[F, K] -> [K / 8, F, 8]: slice s holds columns 8s..8s+7 of every row (W_up)."""
    f, k = weight.shape
    return weight.view(f, k // 8, 8).permute(1, 0, 2)


def _slice_columns(weight: torch.Tensor) -> torch.Tensor:
    """[D, F] -> [D / 8, F, 8]: slice s holds rows 8s..8s+7 of every column, i.e. the columns of
    W^T (W_down)."""
    d, f = weight.shape
    return weight.view(d // 8, 8, f).permute(0, 2, 1)


def _raw_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index)


class _Fill:
    """Where and when an entry was filled: its stream, and an event recorded after the copy."""

    __slots__ = ("stream", "event")

    def __init__(self, device: torch.device):
        self.stream = _raw_stream(device)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))

    def order_use(self, derived: torch.Tensor) -> None:
        """Orders this call's stream after the fill, where it is another stream. While a graph is being
        captured, its stream waited for the stream it was started from (torch.cuda.graph does), and an
        event recorded outside the capture cannot be waited on inside it, so nothing is added there."""
        device = derived.device
        if _raw_stream(device) == self.stream or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.event)
        derived.record_stream(stream)


class DerivedWeightCache:
    """``layout(weight).contiguous()`` (a view of the weight, made contiguous), computed once per
    weight version."""

    def __init__(self, layout, max_entries: int = _MAX_ENTRIES):
        self._layout = layout
        self._entries: OrderedDict[tuple, tuple[StorageWeakRef, int, torch.Tensor, _Fill | None]] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        version = _version(weight)
        if version is None:
            return self._layout(weight).contiguous()
        key = weight_key(weight)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                ref, cached_version, derived, fill = entry
                if not ref.expired() and cached_version == version:
                    self._entries.move_to_end(key)
                    if fill is not None:
                        fill.order_use(derived)
                    return derived
                del self._entries[key]
        view = self._layout(weight)
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return view.contiguous()
        derived = _empty_outside_graph_pools(tuple(view.shape), weight)
        derived.copy_(view)
        fill = _Fill(weight.device) if weight.is_cuda else None
        with self._lock:
            self._entries[key] = (StorageWeakRef(weight.untyped_storage()), version, derived, fill)
            for stale in [k for k, (ref, _, _, _) in self._entries.items() if ref.expired()]:
                del self._entries[stale]
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return derived

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
        leases.revoke_all()  # they hold derived weights too

    def __len__(self) -> int:
        return len(self._entries)


DOWN_WEIGHT_T = DerivedWeightCache(_transpose)
"""``W_down^T`` [F, D] for the row-by-row sparse kernel."""
UP_WEIGHT_SLICED = DerivedWeightCache(_slice_rows)
"""``W_up`` [F, K] as [K / 8, F, 8] for the chunked sparse kernel."""
DOWN_WEIGHT_SLICED = DerivedWeightCache(_slice_columns)
"""``W_down`` [D, F] as [D / 8, F, 8] (``W_down^T``'s columns in slices) for the chunked sparse kernel."""
