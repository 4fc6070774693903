"""``backend="twell"``: run the twell FX passes on the Dynamo graph, then compile it with Inductor.

The rewrite happens before AOTAutograd, so the twell ops' registered autograd gives the backward and
Inductor still compiles and fuses everything around the ops.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import ops  # noqa: F401  (registers torch.ops.twell.* before any graph uses them)
from .options import parse_options
from .passes import run_passes
from .passes.report import RewriteReport

# Reports of the graphs compiled in this process, newest last (see ``last_reports``), with the Dynamo
# compile id of each: a restarted analysis of the same frame calls the backend again under the same id,
# and its report replaces the earlier attempt's instead of counting the graph twice.
_REPORTS: list[RewriteReport] = []
_REPORT_IDS: list[object] = []
_MAX_REPORTS = 256


def add_report(reports: list[RewriteReport], ids: list[object], report: RewriteReport) -> None:
    """Appends ``report`` (and its Dynamo compile id to ``ids``), or, where Dynamo restarted the analysis
    of the frame whose graph the last report is of, puts it in that report's place."""
    from torch._guards import CompileContext

    context = CompileContext.try_get()
    compile_id = context.compile_id if context is not None else None
    # (a restart is a later attempt under the same id: ids alone start over after torch._dynamo.reset(),
    # when a new model's first graph may have the id of the last report's)
    restart = context is not None and context.attempt > 0
    if restart and compile_id is not None and ids and ids[-1] == compile_id:
        reports[-1] = report
    else:
        reports.append(report)
        ids.append(compile_id)


def _record(report: RewriteReport) -> None:
    add_report(_REPORTS, _REPORT_IDS, report)
    del _REPORTS[:-_MAX_REPORTS]
    del _REPORT_IDS[:-_MAX_REPORTS]


def _mode_config_patches(mode: str | None) -> dict[str, Any]:
    """The Inductor settings a mode stands for (``reduce-overhead`` means CUDA graphs): any mode this
    torch's Inductor has (``lite`` too, in 2.11 and later)."""
    if mode is None or mode == "default":
        return {}
    import torch._inductor

    modes = torch._inductor.list_mode_options()
    if mode not in modes:
        raise ValueError(f"twell: unknown mode {mode!r}; expected one of {', '.join(modes)}")
    return dict(modes[mode])


def _keep_cupti_for_cuda_graphs() -> None:
    """What torch.compile's own Inductor wrapper does when CUDA graphs are on (``torch/__init__.py``,
    ``_TorchCompileInductorWrapper``): where the profiler's CUPTI cannot be re-initialised lazily with
    CUDA graphs (CUDA before 12.6, or as torch's internal setting says), it is kept from tearing down,
    which otherwise crashes a profiled run of the captured graphs."""
    from torch import _utils_internal
    from torch.torch_version import TorchVersion

    cuda = getattr(torch.version, "cuda", None)
    allow_lazy_reinit = getattr(_utils_internal, "profiler_allow_cudagraph_cupti_lazy_reinit_cuda12", lambda: True)
    if (cuda is not None and TorchVersion(cuda) < "12.6") or not allow_lazy_reinit():
        os.environ["DISABLE_CUPTI_LAZY_REINIT"] = "1"
        os.environ["TEARDOWN_CUPTI"] = "0"


def twell_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    **unexpected: Any,
) -> Callable[..., Any]:
    """A ``torch.compile`` backend: ``torch.compile(model, backend="twell", mode=..., options=...)``."""
    if unexpected:
        raise TypeError(f"twell: unexpected backend arguments {sorted(unexpected)}; accepted are mode and options")
    twell_options, inductor_patches = parse_options(options)
    config_patches = {**_mode_config_patches(mode), **inductor_patches}
    if config_patches.get("triton.cudagraphs", False):
        _keep_cupti_for_cuda_graphs()

    report = run_passes(gm, twell_options)
    _record(report)
    if twell_options.debug:
        print(report)

    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches)


def last_reports() -> list[RewriteReport]:
    """Rewrite reports of the graphs ``backend="twell"`` compiled in this process, oldest first (the
    latest 256)."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()
    _REPORT_IDS.clear()
