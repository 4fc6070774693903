"""Settings of the twell backend, parsed from ``torch.compile(..., options={...})``.

Keys that name a twell setting configure the rewrite; any other key must be an Inductor config name
(as with ``backend="inductor"``) and is handed to Inductor for this compile only. Anything else is
an error that lists what is accepted, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class TwellOptions:
    gated: bool = True
    """Rewrite gated blocks ``down(relu(gate(x)) * up(x))``."""
    non_gated: bool = True
    """Rewrite non-gated blocks ``down(relu(up(x)))``."""
    debug: bool = False
    """Print the rewrite report of every graph the backend compiles."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _inductor_config_keys() -> set[str]:
    import torch._inductor.config as inductor_config

    return set(inductor_config.get_config_copy().keys())


def _check_inductor_type(key: str, name: str, value: Any) -> None:
    """The type check ``backend="inductor"`` makes (``torch._TorchCompileInductorWrapper``): a string
    ``"False"`` for a bool setting must not silently turn it on."""
    import typing

    import torch._inductor.config as inductor_config

    expected = inductor_config.get_type(name)
    if typing.get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
        raise TypeError(f"twell: Inductor option {key!r} must be a {expected.__name__}, got {value!r}")


INDUCTOR_PREFIX = "inductor."
"""Before an option name, says it is Inductor's: reaches Inductor's ``debug``, which ``debug`` (twell's) hides."""


def parse_options(options: Mapping[str, Any] | None) -> tuple[TwellOptions, dict[str, Any]]:
    """Splits ``options`` into twell settings and Inductor config patches, rejecting unknown keys."""
    if options is None:
        return TwellOptions(), {}
    if not isinstance(options, Mapping):
        raise TypeError(f"twell: options must be a dict, got {type(options).__name__}")
    twell_names = TwellOptions.field_names()
    twell_values: dict[str, Any] = {}
    inductor_patches: dict[str, Any] = {}
    inductor_keys = None
    for key, value in options.items():
        if key in twell_names:
            if not isinstance(value, bool):
                raise TypeError(f"twell: option {key!r} must be a bool, got {value!r}")
            twell_values[key] = value
            continue
        inductor_keys = inductor_keys if inductor_keys is not None else _inductor_config_keys()
        name = key.replace("-", "_") if isinstance(key, str) else key  # (Inductor takes dashed spellings too)
        if isinstance(name, str) and name.startswith(INDUCTOR_PREFIX):
            name = name[len(INDUCTOR_PREFIX):]  # Inductor's namesake of a twell option ("inductor.debug")
        if name in inductor_keys:
            _check_inductor_type(key, name, value)
            inductor_patches[name] = value
            continue
        close = difflib.get_close_matches(key, [*twell_names, *inductor_keys], n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"twell: unknown option {key!r}.{hint} twell options are {', '.join(twell_names)}; "
            f"any Inductor config name (torch._inductor.config) is also accepted, 'inductor.' before it "
            f"to name Inductor's own where twell has one of that name."
        )
    return TwellOptions(**twell_values), inductor_patches
