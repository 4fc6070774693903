"""A fixed draw of the differential fuzzer (``examples/fuzz_kernels.py``) on the GPU: random shapes,
dtypes, sparsity and kernel settings, every output against a float64 reference, element by element.
A failure names its case's seed; ``python examples/fuzz_kernels.py --case-seed N`` reruns it alone."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from helpers import requires_twell_kernels

pytestmark = pytest.mark.cuda

FUZZER = pathlib.Path(__file__).resolve().parent.parent / "examples" / "fuzz_kernels.py"


@requires_twell_kernels
@pytest.mark.parametrize("seed", [1000, 2000])
def test_fuzzed_cases_match_the_reference(seed):
    cases = 40
    result = subprocess.run(
        [sys.executable, str(FUZZER), "--device", "cuda", "--cases", str(cases), "--seed", str(seed),
         "--max-rows", "20000"],
        capture_output=True, text=True, timeout=900,
    )
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert f"{cases} cases in" in result.stdout and "0 failed" in result.stdout, tail
