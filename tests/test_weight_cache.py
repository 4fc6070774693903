"""The weight caches (``kernels/weight_cache.py``) on the CPU: an entry goes with its weight; entries a
CUDA graph capture used are pinned (the graph reads their memory at every replay), refilled in place
when their weight changes, never evicted or dropped while alive; ``weights_changed`` refreshes what the
version counter cannot see, and every optimizer step calls it. The capture is stood in for."""

from __future__ import annotations

import gc

import pytest
import torch

import twell_compile
from twell_compile.kernels import weight_cache
from twell_compile.kernels.weight_cache import DerivedWeightCache


def _cache(**kwargs) -> DerivedWeightCache:
    return DerivedWeightCache(weight_cache._transpose, **kwargs)


def _capturing(monkeypatch, capturing: bool) -> None:
    monkeypatch.setattr(weight_cache, "_capturing", lambda weight: capturing)


def test_an_entry_goes_with_its_weight():
    cache = _cache()
    layer = torch.nn.Linear(8, 16)
    cache.get(layer.weight)
    view_weight = torch.randn(32, 8)[:16]
    cache.get(view_weight)  # a view's entry goes at a later fill
    assert len(cache) == 2
    del layer
    gc.collect()
    assert len(cache) == 1


def test_entries_a_capture_used_are_pinned_and_refilled_in_place(monkeypatch):
    cache = _cache(max_entries=2)
    weight = torch.randn(16, 8)
    first = cache.get(weight)
    _capturing(monkeypatch, True)
    assert cache.get(weight) is first  # the graph records this copy's address
    with torch.no_grad():
        weight.mul_(2)
    in_graph = cache.get(weight)  # stale under a capture: a copy recorded into the graph instead
    assert in_graph is not first and torch.equal(in_graph, weight.t())
    _capturing(monkeypatch, False)
    assert cache.get(weight) is first and torch.equal(first, weight.t())  # refilled where graphs read
    others = [torch.randn(4, 4) for _ in range(3)]
    for other in others:
        cache.get(other)
    assert len(cache) == 2 and cache.get(weight) is first  # evictions take unpinned entries only


def test_weights_changed_refills_pinned_entries_and_drops_the_rest(monkeypatch):
    cache = _cache()
    weight, other = torch.randn(16, 8), torch.randn(4, 4)
    first = cache.get(weight)
    cache.get(other)
    _capturing(monkeypatch, True)
    cache.get(weight)
    _capturing(monkeypatch, False)
    weight.data.mul_(3)  # a write the version counter does not see
    assert cache.get(weight) is first and not torch.equal(first, weight.t())
    cache.clear()
    assert len(cache) == 1 and torch.equal(first, weight.t()) and cache.get(weight) is first


def test_every_optimizer_step_counts_as_a_change():
    """Fused optimizers update in place without bumping the version counter."""
    weight = torch.nn.Parameter(torch.randn(16, 8))
    weight_cache.DOWN_WEIGHT_T.get(weight)  # (the first cached copy starts watching optimizer steps)
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.randn_like(weight)
    version = weight._version
    optimizer.step()
    assert weight._version == version  # what the cache alone could not see
    assert torch.equal(weight_cache.DOWN_WEIGHT_T.get(weight), weight.detach().t())


def test_weights_changed_is_public_and_refreshes_every_cache():
    weight = torch.randn(16, 8)
    stale = weight_cache.DOWN_WEIGHT_T.get(weight)
    weight.data.add_(1)
    assert weight_cache.DOWN_WEIGHT_T.get(weight) is stale
    twell_compile.weights_changed()
    assert torch.equal(weight_cache.DOWN_WEIGHT_T.get(weight), weight.t())


@pytest.mark.parametrize("inference", [False, True])
def test_a_strided_w_down_is_cached_as_given(monkeypatch, inference):
    """The step-by-step path makes W_down contiguous for its kernels, but caches W_down^T for the
    caller's weight: a copy made per call would miss every time (and be an inference tensor under
    inference_mode, which the cache refuses with a warning)."""
    import types
    import warnings

    from twell_compile.kernels import twell_mlp

    fetched = []
    monkeypatch.setattr(twell_mlp.DOWN_WEIGHT_T, "get", lambda weight: fetched.append(weight) or weight.t().contiguous())
    # (its size check reads the call's plan, which asks the extension)
    monkeypatch.setattr(twell_mlp, "call_plan", lambda *args: types.SimpleNamespace(kernels_fit=True))
    down = torch.randn(64, 32).t()  # [32, 64], not contiguous
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode(inference):
            try:
                twell_mlp._twell_mlp_general(torch.randn(4, 16), torch.randn(64, 16), None, None, None, down, None)
            except Exception:  # the CPU has no kernels to launch; the cache was asked before them
                pass
    assert fetched and fetched[0] is down


def test_an_entry_serves_only_the_storage_it_was_made_from(monkeypatch):
    """A storage can outlive its memory (``resize_(0)``, as FSDP frees unsharded parameters), and a new
    weight then get the old one's address, so its key: the entry must not serve it. The address
    reuse is stood in for by one address for every weight."""
    real_key = weight_cache.weight_key
    monkeypatch.setattr(weight_cache, "weight_key", lambda weight: ("one address", *real_key(weight)[1:]))
    cache = _cache()
    old = torch.ones(16, 8)
    cache.get(old)
    old.untyped_storage().resize_(0)  # the storage object lives on
    new = torch.full((16, 8), 2.0)
    assert torch.equal(cache.get(new), new.t())


def test_weights_changed_leaves_a_pinned_copy_whose_weight_moved(monkeypatch):
    """``p.data = other`` gives the weight other memory (maybe another shape): the copy the graphs read
    is left as it is, and the weight's next call gets its own entry."""
    cache = _cache()
    weight = torch.nn.Parameter(torch.randn(16, 8))
    first = cache.get(weight)
    _capturing(monkeypatch, True)
    cache.get(weight)
    _capturing(monkeypatch, False)
    kept = first.clone()
    weight.data = torch.randn(32, 8)
    cache.clear()  # no error, and the pinned copy untouched
    assert torch.equal(first, kept)
    assert torch.equal(cache.get(weight), weight.detach().t())
