"""The attention variants: importing this package registers every built-in one.

Each variant declares itself with one ``@register(...)`` line on its class (name, options
dataclass = config section ``model.<section>.*``, architecture presets): see
:mod:`ranmt.attention.registry`. ``build_attention(name, spec)`` constructs one layer's
module; ``build_shared(name, ...)`` the stack-wide module some variants share across layers
(RAN's initial matrices and transition). An unknown name is an error listing the registered
names.
"""

from __future__ import annotations

from typing import Any

# Importing the variant modules registers them; the order is the order of the option
# sections in a saved config (model.ran, .hardcoded, .recurrent_cross, .synthesizer, .aan).
# isort: off
from ranmt.attention import dot_product, ran, gaussian, recurrent_cross, synthesizer  # noqa: F401
from ranmt.attention import average, ssru  # noqa: F401
# isort: on
from ranmt.attention.base import Attention, AttentionSpec, AttnOutput, reorder_cache
from ranmt.attention.registry import REGISTRY, ROLES, check_name


def build_shared(name: str, role: str, spec: AttentionSpec) -> Any:
    """The stack-wide shared module of a variant (None for most)."""
    cls = check_name(name, role)
    builder = getattr(cls, "build_shared", None)
    return builder(spec) if builder is not None else None


def build_attention(name: str, spec: AttentionSpec) -> Attention:
    """One layer's attention module of variant ``name``."""
    return check_name(name, spec.role)(spec)


__all__ = [
    "REGISTRY", "ROLES", "Attention", "AttentionSpec", "AttnOutput", "build_attention",
    "build_shared", "check_name", "reorder_cache",
]
