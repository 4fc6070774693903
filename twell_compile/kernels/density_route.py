"""Routing by observed density: a layer whose activation keeps sending most of its 128-row blocks to
the dense path runs its calls through cuBLAS's dense MLP instead.

Why: the TwELL path decides per block, on the device, whether a block is sparse enough to pay; a block
that is not runs our dense-path GEMMs. Below the chunked kernel's sizes those GEMMs (and the gate GEMM
before them) are slower than cuBLAS's: with every block dense, calls of 513-8192 rows took 0.65-0.95x
the eager dense MLP, and 32-row calls of skewed activations 0.73-0.86x (H100, 2026-11-25, README's
"Where it stands"). The host cannot know a call's activation without a sync, but it can know what the
same layer's earlier calls did. So each call of the TwELL path (and each call routed to cuBLAS, from
its dense activation) may report its count of dense blocks: a 4-byte copy, on the call's stream, into
a word of pinned host memory that holds -1 until the copy lands (the words are allocated once and
reused: a pinned allocation per report doubled the host time of decode-sized calls on an H100). A later
call reads the reports that have landed, in order, from host memory alone: no CUDA call, so nothing
waits on the GPU, and it works while a CUDA graph is being captured (where even ``cudaEventQuery`` is
not allowed).

Per layer and size class (the classes whose dense-block thresholds differ: decode-sized calls, up to
4096 rows, larger), the shares are averaged (each new report weighs half). A call goes to cuBLAS once
its class's average reaches ``enter_share`` of its row count, and a routed class's calls come back to
TwELL once it falls below half of that (hysteresis, so a layer near the boundary does not flip every
call). The threshold grows with the row count: at 768-2048 rows a call with any dense block pays for the
dense path's GEMMs about as much as one whose blocks are all dense, and loses to cuBLAS; at 16384 rows
the paths cross at about three quarters of the blocks dense (``ENTER_SHARES``). Where the row-by-row
sparse kernel would run a thin last wave, the reports count a block as dense from a lower density than
the kernels' own test (``twell_mlp.thin_sparse_wave``, ``config.thin_wave_route_density``): there a call
with no dense block still lost to cuBLAS at 36-40 active units per row. Reports are sampled:
the first ``FIRST_REPORTS`` calls of a class, then one call in ``config.route_report_every``.

A layer is its activated projection's weight (the gate's, or the up projection's where non-gated),
keyed as the weight caches key it: by storage, checked alive with a weak reference, so a freed weight
whose address is reused starts afresh; nothing is keyed by layer numbers. A call captured in a CUDA
graph makes no report and takes the route its layer's reports give once all of them have landed: the
capture waits for them (host memory only, at most ``CAPTURE_WAIT_S``, without holding the router's lock,
so other threads' calls go on), since the graph keeps that route
for every replay. torch.compile's ``mode="reduce-overhead"`` records its graph on its second call,
right after one warm-up call, whose reports are the ones waited for; capture is not the hot path.

Both routes compute the same MLP: the TwELL path to within bf16/fp16 rounding of eager, the cuBLAS route
bit for bit as eager. A layer's results can therefore change at the rounding level when its route
changes; ``config.route_by_density = False`` (``TWELL_ROUTE_BY_DENSITY=0``) keeps every call on the
path its row count picks.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import threading
import time
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import leases
from .weight_cache import _capturing, weight_key

ENTER_SHARES = ((1024, 0.05), (2048, 0.06), (4096, 0.30), (8192, 0.55), (16384, 0.75))
"""(rows, average dense-block share from which calls of that many rows go to cuBLAS), interpolated in
log2(rows) between the points and held beyond them. Where the TwELL path (its dense path on 128-row
tiles walking only the dense row tiles) crossed the cuBLAS MLP on calls with a share of their blocks
dense at random (80 active units per row) and the rest at 24 or 39 (H100, bf16, CUDA graphs,
2026-11-28, ``examples/sweep_route_share.py``; twell/cuBLAS time at shares 0, 1/16, 1/4, 1/2, 3/4):
1024 rows 0.87, 0.88 (no block dense yet), 1.38, 1.46; 2048 rows 0.75-0.94, 1.03-1.19, 1.07-1.18,
1.11-1.18, 1.31-1.34; 4096 rows 0.69-0.86, 0.85-0.98, 0.87-0.97, 0.99-1.07, 1.10-1.14; 8192 rows
0.65-0.80, 0.75-0.85, 0.83-0.90, 0.89-0.98, 1.02-1.06; 16384 rows 0.60-0.72, 0.64-0.73, 0.73-0.80,
0.86-0.87, 0.91-0.97. At 24 units the paths cross at about 1/2 (4096 rows), 5/8 (8192) and past 3/4
(16384); at 39 units at about 1/3, 5/9 and 3/4. A dense block costs the dense path's GEMMs a fixed
~45 us at up to 2048 rows (~55 before they split K by themselves for few dense tiles; 1024 rows, 24 units:
96 us with none dense, 140 with one of 8, against 108 for cuBLAS), which cuBLAS's 110-210 us leave no room
for. Checked again with that split (same script): 1536 rows lost with one block of 12 (1.09-1.23x), 2048
rows with one of 16 at 39 units (1.10x), and 3072 rows crossed between 1/8 and 1/4 at 39 units (0.98x,
1.02x), where the interpolation gives 20%."""
DECODE_ENTER_SHARE = 0.5
"""The same for decode-sized calls (one 128-row block, so the share is the fraction of calls whose block
is dense): there the dense path costs about what cuBLAS does (32 rows at 80 active units per row, 42.9
against 40.8 us, H100) while a sparse block saves a quarter or more, so a layer goes only when most
calls are dense."""
LEAVE_FRACTION = 0.5
"""A routed class's calls come back to TwELL once its average share falls below this fraction of the
entering share."""


@functools.lru_cache(maxsize=256)  # asked on every routed call; the answer depends on these two alone
def enter_share(rows: int, size_class: str) -> float:
    """The average dense-block share from which a call of ``rows`` rows of this size class goes to cuBLAS."""
    if size_class == "decode":
        return DECODE_ENTER_SHARE
    points = ENTER_SHARES
    if rows <= points[0][0]:
        return points[0][1]
    for (m0, s0), (m1, s1) in zip(points, points[1:]):
        if rows <= m1:
            t = (math.log2(rows) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return s0 + t * (s1 - s0)
    return points[-1][1]


FIRST_REPORTS = 2
"""Calls of a class that always report, so that a new layer's route settles within a few calls."""


def next_report_call(calls: int, report_every: int) -> int:
    """The number of the first call from call ``calls`` on (calls of a class counted from 0) that reports:
    the first ``FIRST_REPORTS``, then one in ``report_every``."""
    if calls < FIRST_REPORTS:
        return calls
    every = max(report_every, 1)
    return -(-calls // every) * every


MAX_PENDING = 4
"""Reports in flight per layer; past it a call makes none (the GPU is far behind the host)."""
CAPTURE_WAIT_S = 2.0
"""Longest a captured call waits for its layer's reports to land (they wait only for work the GPU was
given before the capture began); past it, the route known by then is captured."""
_NOT_LANDED = -1  # a report's host word until its copy lands
_REPORT_WORDS = 1024
_MAX_LAYERS = 1 << 16
"""Layers the router keeps (least recently called first out): far past any model's, so that a model's
layers (or a ReLU MoE's experts) called in turn are never evicted before their next call, which would
make every call a first call that reports and is never routed. A layer costs a few hundred bytes."""


class _ReportWords:
    """The int32 words reports land in: one pinned tensor, read and written by the host through ctypes
    (an element access of the tensor costs microseconds), each word handed out to one report at a time."""

    def __init__(self, size: int, pinned: bool = True):
        self.tensor = torch.full((size,), _NOT_LANDED, dtype=torch.int32, pin_memory=pinned)
        self._view = (ctypes.c_int32 * size).from_address(self.tensor.data_ptr())
        self._free = list(range(size))
        self._abandoned: list[int] = []  # words of dropped layers' reports, maybe still in flight

    def take(self) -> int | None:
        if not self._free:
            self._free = [w for w in self._abandoned if self._view[w] != _NOT_LANDED]
            self._abandoned = [w for w in self._abandoned if self._view[w] == _NOT_LANDED]
        if not self._free:
            return None
        word = self._free.pop()
        self._view[word] = _NOT_LANDED
        return word

    def landed(self, word: int) -> int | None:
        value = self._view[word]
        return None if value == _NOT_LANDED else value

    def release(self, word: int) -> None:
        self._free.append(word)

    def abandon(self, words) -> None:
        self._abandoned.extend(words)


@dataclasses.dataclass
class _ClassState:
    calls: int = 0
    share: float | None = None  # average dense-block share of the reports read so far
    cublas: bool = False  # the route of the class's last call (for the hysteresis)


@dataclasses.dataclass
class _Layer:
    ref: StorageWeakRef
    classes: dict[str, _ClassState] = dataclasses.field(default_factory=dict)
    pending: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # class, word, blocks


class DensityRouter:
    """Per layer and size class: the running dense-block share of reported calls, and the route it sets."""

    def __init__(self, max_layers: int = _MAX_LAYERS):
        self._layers: OrderedDict[tuple, _Layer] = OrderedDict()
        self._max_layers = max_layers
        self._lock = threading.Lock()
        self._words: _ReportWords | None = None  # allocated at the first report from a GPU

    def decide(self, weight: torch.Tensor, size_class: str, report_every: int, rows: int) -> tuple[bool, bool]:
        """(whether this call of ``rows`` rows goes to cuBLAS, whether it should report its dense-block share).
        Inside ``paused()``: (False, False), and the router is left as it was."""
        if _paused():
            return False, False
        capturing = _capturing(weight)
        if capturing:
            self._await_reports(weight, CAPTURE_WAIT_S)
        with self._lock:
            layer = self._layer(weight, create=not capturing)
            if layer is None:
                return False, False
            if layer.pending:
                self._read_landed(layer)
            state = layer.classes.get(size_class)  # (setdefault would build a _ClassState every call)
            if state is None:
                state = layer.classes[size_class] = _ClassState()
            if state.share is not None:
                enter = enter_share(rows, size_class)
                state.cublas = state.share >= (LEAVE_FRACTION * enter if state.cublas else enter)
            if capturing:
                return state.cublas, False
            calls, state.calls = state.calls, state.calls + 1
            wants = next_report_call(calls, report_every) == calls
            return state.cublas, wants and len(layer.pending) < MAX_PENDING

    def lease_calls(self, weight: torch.Tensor, size_class: str, report_every: int) -> int:
        """How many of this layer's next calls of the class may take the route ``decide`` gave its last call
        without asking (``leases.py``): none while its reports are in flight (they may change the route) or
        while a report is due next; else the calls before the next one due to report. Their route cannot
        change meanwhile: only a report moves the share, and only a call on the Python path (of another
        row count, through the hysteresis) can flip the route, and every such call ends the layer's lease
        first. The calls a lease serves are added then (``count_calls``)."""
        if _paused():
            return 0
        with self._lock:
            layer = self._layer(weight, create=False)
            if layer is None or layer.pending:
                return 0
            state = layer.classes.get(size_class)
            return 0 if state is None else next_report_call(state.calls, report_every) - state.calls

    def count_calls(self, weight: torch.Tensor, size_class: str, calls: int) -> None:
        """Counts ``calls`` calls of the class that a lease served without asking (``leases.py``). (Also
        inside ``paused()``: the calls were served before, outside it.)"""
        with self._lock:
            layer = self._layer(weight, create=False)
            state = None if layer is None else layer.classes.get(size_class)
            if state is not None:
                state.calls += calls

    def report(self, weight: torch.Tensor, size_class: str, dense_blocks: torch.Tensor, blocks: int) -> None:
        """A call's count of dense blocks (a 0-d integer tensor on the call's device) out of ``blocks``.
        On a CUDA device it is copied on the current stream and read at a later call, once landed;
        elsewhere it is read at once. The layer's lease, if any, is revoked: its route may change.
        Inside ``paused()`` nothing is recorded."""
        if _paused():
            return
        leases.revoke(weight)
        if blocks <= 0:
            return
        if not dense_blocks.is_cuda:
            with self._lock:
                layer = self._layer(weight, create=True)
                self._update(layer.classes.setdefault(size_class, _ClassState()), int(dense_blocks) / blocks)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        with self._lock:
            if self._words is None:
                self._words = _ReportWords(_REPORT_WORDS)
            word = self._words.take()
            if word is None:  # every word in flight
                return
            # 4 aligned bytes, on the current stream after the count: they land whole. Queued before the
            # report is listed: a copy that failed would leave the layer waiting on a word never written.
            try:
                self._words.tensor[word].copy_(dense_blocks, non_blocking=True)
            except BaseException:
                self._words.abandon([word])  # (reused only once it holds a count, so never)
                raise
            self._layer(weight, create=True).pending.append((size_class, word, blocks))

    def share(self, weight: torch.Tensor, size_class: str) -> float | None:
        """The average dense-block share read so far for this layer and class (None: no report yet)."""
        with self._lock:
            layer = self._layer(weight, create=False)
            if layer is None:
                return None
            self._read_landed(layer)
            state = layer.classes.get(size_class)
            return None if state is None else state.share

    def clear(self) -> None:
        with self._lock:
            for key in list(self._layers):
                self._drop(key)
        leases.revoke_all()

    def __len__(self) -> int:
        return len(self._layers)

    def _await_reports(self, weight: torch.Tensor, wait_s: float) -> None:
        """Waits up to ``wait_s`` for the layer's reports in flight to land, reading them as they do. The
        lock is held only to read: other threads' calls (of other layers, or not captured) go on
        meanwhile."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                layer = self._layer(weight, create=False)
                if layer is None or not layer.pending:
                    return
                self._read_landed(layer)
                if not layer.pending:
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(50e-6)

    # Callers hold the lock.
    def _layer(self, weight: torch.Tensor, create: bool) -> _Layer | None:
        key = weight_key(weight)
        layer = self._layers.get(key)
        if layer is not None and layer.ref.expired():
            self._drop(key)
            layer = None
        if layer is None and create:
            layer = self._layers[key] = _Layer(StorageWeakRef(weight.untyped_storage()))
            for stale in [k for k, v in self._layers.items() if v.ref.expired()]:
                self._drop(stale)
            while len(self._layers) > self._max_layers:
                self._drop(next(iter(self._layers)))
        if layer is not None:
            self._layers.move_to_end(key)
        return layer

    def _drop(self, key: tuple) -> None:
        layer = self._layers.pop(key)
        if layer.pending:
            self._words.abandon(word for _, word, _ in layer.pending)

    def _read_landed(self, layer: _Layer) -> None:
        """Reads the layer's reports whose copies have landed, oldest first (host memory only)."""
        while layer.pending:
            size_class, word, blocks = layer.pending[0]
            dense = self._words.landed(word)
            if dense is None:
                return
            layer.pending.pop(0)
            self._words.release(word)
            self._update(layer.classes.setdefault(size_class, _ClassState()), dense / blocks)

    @staticmethod
    def _update(state: _ClassState, share: float) -> None:
        state.share = share if state.share is None else 0.5 * (state.share + share)


_PAUSED = threading.local()


def _paused() -> bool:
    return getattr(_PAUSED, "on", False)


@contextlib.contextmanager
def paused():
    """Calls made inside (on this thread) neither read nor feed the router: they take the route their
    row count gives and report nothing. For runs that must leave the model's routing as they found it,
    such as ``twell_compile.explain``'s analysis run. (A call a layer's lease serves keeps the lease's
    route; leases serve no call made under a sparsity recorder, as explain's are.)"""
    before = _paused()
    _PAUSED.on = True
    try:
        yield
    finally:
        _PAUSED.on = before


ROUTER = DensityRouter()
