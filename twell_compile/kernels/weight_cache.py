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

CUDA graphs: while a graph is captured nothing is cached (a miss records the copy into the graph,
replayed with it). Cudagraph trees also run a warm-up with this thread's allocations routed to their
private pool, which must hold nothing but tracked outputs afterwards; so an entry's storage is
allocated from a short-lived helper thread (default pool) and only filled on the current stream.
An entry a capture used (a hit) is pinned, since the graph reads its memory at every replay: no
eviction, ``clear`` or version change frees it, only its weight's death does. A version change
outside a capture refills a pinned entry in place, so the graphs read the new values from then on;
until such a call (say, graphs replayed right after an in-place update of W_down) they read the old
ones, and so does every call after an update the version counter does not see (writes through
``.data``, say): ``weights_changed`` (``twell_compile.weights_changed``, and after every optimizer
step by itself) refills the pinned entries and drops the others.

Entries of weights that are not views are dropped as soon as the weight is freed (their weak reference's
callback); the others, and pinned ones, when the next entry is filled.
"""

from __future__ import annotations

import threading
import warnings
import weakref
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
    # Allocated from our stream's pool, as an allocation on this thread would be: from the helper's own
    # (default) stream, a block freed there could still be in use by work queued on it, which the copy
    # on our stream would not wait for.
    stream = torch.cuda.current_stream(like.device)

    def allocate():
        with torch.cuda.stream(stream):
            result.append(torch.empty(shape, dtype=like.dtype, device=like.device))

    helper = threading.Thread(target=allocate)
    helper.start()
    helper.join()
    return result[0]


def weight_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight to the caches (and to density_route.py) while its storage is alive: its
    address and its storage object too, since a storage can outlive its memory (``storage.resize_(0)``,
    as FSDP frees unsharded parameters) and another weight then get the same address. (An entry's weak
    reference keeps its storage object allocated, so no other storage can take that object's place.)"""
    # (torch.Size is a tuple and stride() returns one: no conversions, this runs several times a call)
    return (weight.data_ptr(), weight.untyped_storage()._cdata, weight.device, weight.dtype, weight.shape,
            weight.stride())


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


def _capturing(weight: torch.Tensor) -> bool:
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


class _Entry:
    """A derived weight: its source's storage (weakly), the source's version it was made from, the copy,
    its fill (CUDA), whether a captured graph reads it (pinned), and the source itself (weakly) where
    it is no view: ``clear`` refills a pinned copy from it, and ``on_freed`` runs when it is freed."""

    __slots__ = ("ref", "version", "derived", "fill", "pinned", "source")

    def __init__(self, weight: torch.Tensor, version: int, derived: torch.Tensor, on_freed):
        self.ref = StorageWeakRef(weight.untyped_storage())
        self.version = version
        self.derived = derived
        self.fill = _Fill(weight.device) if weight.is_cuda else None
        self.pinned = False
        self.source = weakref.ref(weight, on_freed) if weight._base is None else None

    def refill(self, view: torch.Tensor, version: int, device: torch.device) -> None:
        """Copies ``view`` (the layout of the source's ``version``) into the derived weight in place, where
        the graphs that pinned it read it; a use on another stream then waits for this copy."""
        self.derived.copy_(view)
        self.version = version
        self.fill = _Fill(device) if self.derived.is_cuda else None


class DerivedWeightCache:
    """``layout(weight).contiguous()`` (a view of the weight, made contiguous), computed once per
    weight version."""

    def __init__(self, layout, max_entries: int = _MAX_ENTRIES):
        self._layout = layout
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._max_entries = max_entries
        # Reentrant: a weight's callback (_forget) may run from a garbage collection inside a locked block.
        self._lock = threading.RLock()

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        version = _version(weight)
        if version is None:
            return self._layout(weight).contiguous()
        key = weight_key(weight)
        capturing = _capturing(weight)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.ref.expired():
                del self._entries[key]
                entry = None
            if entry is not None and entry.version == version:
                self._entries.move_to_end(key)
                entry.pinned |= capturing  # the graph reads this copy at every replay: keep it
                if entry.fill is not None:
                    entry.fill.order_use(entry.derived)
                return entry.derived
            if entry is not None and not entry.pinned:
                del self._entries[key]
                entry = None
        view = self._layout(weight).detach()  # (a copy outside autograd, which would hold the weight alive)
        if capturing:  # recorded into the graph (a stale pinned entry is refilled at the next call outside)
            return view.contiguous()
        if entry is not None:  # pinned and stale: refilled in place, where the graphs read it
            with self._lock:
                entry.refill(view, version, weight.device)
            return entry.derived
        _watch_optimizer_steps()
        derived = _empty_outside_graph_pools(tuple(view.shape), weight)
        derived.copy_(view)
        with self._lock:
            # (the callback holds the key, not the entry: a replaced entry's reference dies with it, unrun)
            self._entries[key] = _Entry(weight, version, derived, lambda ref, k=key: self._forget(k, ref))
            for stale in [k for k, e in self._entries.items() if e.ref.expired()]:
                del self._entries[stale]
            unpinned = (k for k, e in list(self._entries.items()) if not e.pinned)
            while len(self._entries) > self._max_entries and (oldest := next(unpinned, None)) is not None:
                del self._entries[oldest]
        return derived

    def _forget(self, key: tuple, source: weakref.ref) -> None:
        """The weight of ``key``'s entry is freed: the entry goes (a view's entry goes at a later fill),
        unless a captured graph reads it (then it goes once its storage is gone too, at a later fill; at
        this point the storage is not freed yet)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.source is source and not entry.pinned:
                del self._entries[key]

    def clear(self) -> None:
        """Drops every entry but those captured graphs read, which are refilled from their weights in
        place (where the weight is alive and no view; else kept as they are), so that the graphs read
        the weights' current values."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("twell: the weight caches cannot be cleared while a CUDA graph is being captured")
        with self._lock:
            pinned = {key: entry for key, entry in self._entries.items() if entry.pinned and not entry.ref.expired()}
            self._entries = OrderedDict(pinned)
        for key, entry in pinned.items():
            source = entry.source() if entry.source is not None else None
            # (only from the same storage and shape: a weight given other memory, ``p.data = t``, is no
            # longer what the graphs read)
            if source is not None and weight_key(source) == key:
                version = _version(source)
                with self._lock:
                    entry.refill(self._layout(source).detach(), -1 if version is None else version, source.device)
        leases.revoke_all()  # they hold derived weights too

    def __len__(self) -> int:
        return len(self._entries)


def weights_changed() -> None:
    """Tells twell that weights may have changed in a way their version counters do not show: writes
    through ``.data``, from DLPack or NumPy, by collectives, or by optimizers whose fused kernels skip
    the counter (``torch.optim.AdamW(fused=True)``: twell calls this after every optimizer step by
    itself). The re-laid copies of the weights are made again at their next use; those that captured
    CUDA graphs read are refilled in place now, so that the graphs read the current weights; leases
    are revoked. Not while a CUDA graph is being captured."""
    for cache in (DOWN_WEIGHT_T, UP_WEIGHT_SLICED, DOWN_WEIGHT_SLICED):
        cache.clear()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    # (an optimizer step captured into a CUDA graph leaves the caches alone: nothing may be copied then)
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        weights_changed()


_optimizer_hook = None


def _watch_optimizer_steps() -> None:
    """From the first cached copy on: every optimizer step, whatever its kind, counts as a change."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _optimizer_hook = register_optimizer_step_post_hook(_after_optimizer_step)


DOWN_WEIGHT_T = DerivedWeightCache(_transpose)
"""``W_down^T`` [F, D] for the row-by-row sparse kernel."""
UP_WEIGHT_SLICED = DerivedWeightCache(_slice_rows)
"""``W_up`` [F, K] as [K / 8, F, 8] for the chunked sparse kernel."""
DOWN_WEIGHT_SLICED = DerivedWeightCache(_slice_columns)
"""``W_down`` [D, F] as [D / 8, F, 8] (``W_down^T``'s columns in slices) for the chunked sparse kernel."""
