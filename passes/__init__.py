"""FX graph passes of the twell backend (installed as ``twell_compile.passes``).

``run_passes(gm, options)`` rewrites ReLU MLP blocks of a GraphModule into ``torch.ops.twell`` calls
in place and returns a ``RewriteReport`` of every candidate block, rewritten or left alone.
"""

from .pass_manager import GraphPass, TwellPassManager, run_passes
from .relu_mlp_fusion import ReluMlpFusionPass
from .report import CandidateBlock, RewriteReport

__all__ = [
    "CandidateBlock",
    "GraphPass",
    "ReluMlpFusionPass",
    "RewriteReport",
    "TwellPassManager",
    "run_passes",
]
