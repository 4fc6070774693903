"""What the passes did to a graph: every candidate block, rewritten or left alone, and why."""

from __future__ import annotations

import dataclasses
import textwrap
from collections import Counter

GATED = "gated"
NON_GATED = "non_gated"
REWRITTEN = "rewritten"
LEFT_ALONE = "left_alone"


@dataclasses.dataclass
class CandidateBlock:
    """One MLP block the matcher found, with the code it matched and what became of it."""

    kind: str
    """``"gated"`` (``down(act(gate(x)) * up(x))``) or ``"non_gated"`` (``down(act(up(x)))``)."""
    status: str
    """``"rewritten"`` or ``"left_alone"``."""
    reason: str
    """Why it was left alone, or what was matched when it was rewritten."""
    module_path: str
    """Module the block lives in, e.g. ``model.layers.0.mlp`` (node names when no module is known)."""
    before: str
    """Python-like code of the matched region, one line per node."""
    after: str = ""
    """The replacement call (empty when left alone)."""

    @property
    def rewritten(self) -> bool:
        return self.status == REWRITTEN

    @property
    def layer(self) -> str:
        """The enclosing layer: the path up to its last numeric part (``model.layers.3``), else the path."""
        parts = self.module_path.split(".")
        numeric = [i for i, part in enumerate(parts) if part.isdigit()]
        return ".".join(parts[: numeric[-1] + 1]) if numeric else self.module_path

    def __str__(self) -> str:
        status = "REWRITTEN" if self.rewritten else "LEFT ALONE"
        lines = [f"{self.module_path or '<graph>'} [{self.kind}] {status}: {self.reason}"]
        lines.append("  before:")
        lines.append(textwrap.indent(self.before or "<nothing>", "    "))
        if self.after:
            lines.append("  after:")
            lines.append(textwrap.indent(self.after, "    "))
        return "\n".join(lines)


@dataclasses.dataclass
class RewriteReport:
    """The account of one graph's rewrite, built by the pass manager."""

    candidates: list[CandidateBlock] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    """Wall time of all passes, including the final recompile."""
    pass_times_s: dict[str, float] = dataclasses.field(default_factory=dict)
    graph_name: str = ""

    @property
    def rewritten(self) -> list[CandidateBlock]:
        return [c for c in self.candidates if c.rewritten]

    @property
    def left_alone(self) -> list[CandidateBlock]:
        return [c for c in self.candidates if not c.rewritten]

    @property
    def rewritten_count(self) -> int:
        return len(self.rewritten)

    @property
    def left_alone_count(self) -> int:
        return len(self.left_alone)

    @property
    def gated_count(self) -> int:
        """Gated blocks rewritten."""
        return sum(1 for c in self.rewritten if c.kind == GATED)

    @property
    def non_gated_count(self) -> int:
        """Non-gated blocks rewritten."""
        return sum(1 for c in self.rewritten if c.kind == NON_GATED)

    @property
    def counts(self) -> dict[str, int]:
        return {
            "candidates": len(self.candidates),
            REWRITTEN: self.rewritten_count,
            LEFT_ALONE: self.left_alone_count,
            GATED: self.gated_count,
            NON_GATED: self.non_gated_count,
        }

    @property
    def per_layer_counts(self) -> dict[str, dict[str, int]]:
        """``{layer: {"rewritten": n, "left_alone": m}}`` in the order layers first appear."""
        layers: dict[str, Counter] = {}
        for candidate in self.candidates:
            layers.setdefault(candidate.layer, Counter())[candidate.status] += 1
        return {layer: {REWRITTEN: c[REWRITTEN], LEFT_ALONE: c[LEFT_ALONE]} for layer, c in layers.items()}

    @property
    def reasons(self) -> list[str]:
        """Reasons of the blocks left alone, in graph order."""
        return [c.reason for c in self.left_alone]

    def merge(self, candidates: list[CandidateBlock]) -> None:
        self.candidates.extend(candidates)

    def __str__(self) -> str:
        title = f"twell rewrite report{f' for {self.graph_name}' if self.graph_name else ''}"
        summary = (
            f"{title}: {len(self.candidates)} candidate block(s), {self.rewritten_count} rewritten "
            f"({self.gated_count} gated, {self.non_gated_count} non-gated), {self.left_alone_count} left alone "
            f"[{self.elapsed_s * 1e3:.1f} ms]"
        )
        lines = [summary]
        for i, candidate in enumerate(self.candidates, 1):
            lines.append(textwrap.indent(f"[{i}] {candidate}", "  "))
        if self.candidates:
            lines.append("  per layer:")
            for layer, counts in self.per_layer_counts.items():
                counted = f"{counts[REWRITTEN]} rewritten, {counts[LEFT_ALONE]} left alone"
                lines.append(f"    {layer or '<graph>'}: {counted}")
        if self.pass_times_s:
            timings = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in self.pass_times_s.items())
            lines.append(f"  passes: {timings}")
        return "\n".join(lines)
