"""Shared pytest setup: every test starts from a seeded RNG and a fresh Dynamo state."""

from __future__ import annotations

import random
import sys

import pytest
import torch


def _reset_compiler_state() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # The backend keeps the reports of the graphs it compiled; only clear them if something already
    # imported it (importing it here would hide import errors from the tests that check them).
    backend = sys.modules.get("twell_compile.backend")
    if backend is not None:
        backend.clear_reports()


@pytest.fixture(autouse=True)
def _seeded_fresh_compiler():
    random.seed(0)
    torch.manual_seed(0)
    _reset_compiler_state()
    yield
    _reset_compiler_state()


@pytest.fixture(autouse=True)
def _leases_restored(monkeypatch):
    """Tests that stand a recording object in for the CUDA extension may grant leases through it
    (twell_compile/kernels/leases.py keeps the extension it first granted with): put back what was there."""
    leases = sys.modules.get("twell_compile.kernels.leases")
    if leases is not None:
        monkeypatch.setattr(leases, "_ext", leases._ext)
        monkeypatch.setattr(leases, "FAST_MLP", leases.FAST_MLP)
