"""The timing helpers of ``twell_compile.testing`` refuse bad settings before touching a GPU."""

from __future__ import annotations

import pytest

from twell_compile.testing import cuda_graph_time_ms


def test_graph_timing_needs_at_least_one_call_per_graph():
    called = []
    with pytest.raises(ValueError, match="calls must be at least 1"):
        cuda_graph_time_ms(lambda: called.append(1), reps=3, calls=0)
    assert not called, "fn ran before the settings were checked"
