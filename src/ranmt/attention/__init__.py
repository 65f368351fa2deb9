"""Registry of attention variants: name -> class.

``build_attention(name, spec)`` constructs one layer's module; ``build_shared(name, ...)``
the stack-wide module some variants share across layers (RAN's initial matrices and
transition). An unknown name is an error listing the registered names.
"""

from __future__ import annotations

from typing import Any

from ranmt.attention.base import Attention, AttentionSpec, AttnOutput, reorder_cache
from ranmt.attention.dot_product import DotProductAttention
from ranmt.attention.gaussian import GaussianAttention
from ranmt.attention.ran import RecurrentAttention
from ranmt.attention.recurrent_cross import VARIANTS as RECURRENT_CROSS
from ranmt.attention.synthesizer import RandomSynthesizerAttention

REGISTRY: dict[str, type[Attention]] = {
    "dot": DotProductAttention,
    "ran": RecurrentAttention,
    "gaussian": GaussianAttention,
    "synthesizer": RandomSynthesizerAttention,
    **RECURRENT_CROSS,
}

ROLES = ("encoder_self", "decoder_self", "cross")


def check_name(name: str, role: str) -> type[Attention]:
    """The class registered as ``name`` (error if unknown or not usable for ``role``)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown attention '{name}' for {role}; registered: {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    allowed = getattr(cls, "roles", ROLES)
    if role not in allowed:
        raise ValueError(f"attention '{name}' cannot be used for {role} (only {allowed})")
    return cls


def build_shared(name: str, role: str, spec: AttentionSpec) -> Any:
    """The stack-wide shared module of a variant (None for most)."""
    cls = check_name(name, role)
    builder = getattr(cls, "build_shared", None)
    return builder(spec) if builder is not None else None


def build_attention(name: str, spec: AttentionSpec) -> Attention:
    """One layer's attention module of variant ``name``."""
    return check_name(name, spec.role)(spec)


__all__ = [
    "REGISTRY", "Attention", "AttentionSpec", "AttnOutput", "build_attention", "build_shared",
    "reorder_cache",
]
