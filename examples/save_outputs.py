"""Save the outputs of a few seeded twell calls, or compare two such files bit for bit.

For A/Bs of a change meant to leave results unchanged (e.g. a faster planner producing the same plans):
run ``save`` under each build (examples/ab_setup.sh's ``variant_path``), then ``compare``.

    python examples/save_outputs.py save OUT.pt
    python examples/save_outputs.py compare A.pt B.pt
"""

from __future__ import annotations

import sys

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.testing import make_problem

# (rows, active units per row, skewed, biases, gated): the chunked kernel from 32768 rows, the
# row-by-row kernel below it, skewed rows for heavy rows and dense blocks.
CASES = [
    (131072, 24, False, False, True),
    (65536, 80, False, True, True),
    (40000, 39, True, False, True),
    (40000, 24, False, True, False),
    (4097, 24, False, False, True),
]


def save(path: str) -> None:
    outputs = {}
    for m, nnz, skew, bias, gated in CASES:
        generator = torch.Generator(device="cuda").manual_seed(m + nnz)
        p = make_problem(m, 2048, 5632, nnz_per_row=nnz, skew=skew, bias=bias, gated=gated, generator=generator)
        op = torch.ops.twell.gated_relu_mlp if gated else torch.ops.twell.relu_mlp
        out = op(*(p.gated_args() if gated else p.non_gated_args()))
        outputs[f"m{m}_nnz{nnz}_skew{int(skew)}_bias{int(bias)}_gated{int(gated)}"] = out.cpu()
    torch.save(outputs, path)
    print(f"saved {len(outputs)} outputs to {path}")


def compare(path_a: str, path_b: str) -> int:
    a, b = torch.load(path_a), torch.load(path_b)
    failures = 0
    for key in a:
        same = torch.equal(a[key].view(torch.int16), b[key].view(torch.int16))
        failures += not same
        print(f"{key:<40} {'bitwise equal' if same else 'DIFFERENT'}")
    return failures


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
