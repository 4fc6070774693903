"""twell_compile: a torch.compile backend that runs ReLU MLP blocks on TwELL sparse kernels.

    model = torch.compile(model, backend="twell")

finds every ReLU MLP block (``down(relu(gate(x)) * up(x))`` and ``down(relu(up(x)))``) in the
captured graph, rewrites it to a ``torch.ops.twell`` op, and compiles the rest with Inductor.
"""

from . import ops  # noqa: F401  (registers torch.ops.twell.*)
from .api import ExplainReport, explain, rewrite
from .backend import last_reports, twell_backend
from .graph_export import to_networkx
from .kernels.weight_cache import weights_changed
from .options import TwellOptions
from .stats import record_sparsity


def _register_backend() -> None:
    # The torch_dynamo_backends entry point registers "twell" lazily on first lookup; register it here
    # too for checkouts used without installing, but never twice (register_backend asserts on that).
    import torch._dynamo

    if "twell" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(twell_backend, name="twell")


_register_backend()

__all__ = [
    "ExplainReport",
    "TwellOptions",
    "explain",
    "last_reports",
    "record_sparsity",
    "rewrite",
    "to_networkx",
    "twell_backend",
    "weights_changed",
]
