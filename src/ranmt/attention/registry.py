"""Where attention variants declare themselves: one ``@register(...)`` line per class.

A variant's registration carries everything the rest of ranmt needs to know about it:

- its **name** (what ``model.encoder.self_attention`` / ``model.decoder.self_attention`` /
  ``model.decoder.cross_attention`` take) and the roles it may fill (the class's ``roles``);
- its **options**: a dataclass whose fields become the config keys
  ``model.<section>.<field>`` (typed, defaulted, validated and saved with every checkpoint,
  like every other key). The dataclass may define ``validate(self)`` (raise ``ValueError``
  naming the field) and ``fill_from_data(self, meta)`` (values the prepared data decides);
- its **architecture presets** (``model.arch`` names: which variant fills each role).

Example (a new variant is this and its class, in one file)::

    @dataclass
    class ToyOptions:
        sharpness: float = 1.0

    @register("toy", options=ToyOptions, archs={"toy-all": Arch("toy", "toy")})
    class ToyAttention(DotProductAttention): ...

This module itself imports no torch (its package does, to register the built-in variants):
``ranmt.config`` imports it when a config is first built, to know the option sections, the
presets and the names; ``ranmt.model.build_model`` reads it to construct the modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROLES = ("encoder_self", "decoder_self", "cross")


@dataclass(frozen=True)
class Arch:
    """An architecture preset: the registered variant of each attention role."""

    encoder_self: str
    decoder_self: str
    cross: str = "dot"
    cross_layers: str = "all"
    """Decoder layers with cross-attention: all | last (SH-X)."""
    cross_heads: int = 0
    """Heads of the cross-attention (0 = model.heads)."""


REGISTRY: dict[str, type] = {}
"""Variant name -> attention class (an ``ranmt.attention.base.Attention`` subclass)."""
SECTIONS: dict[str, type] = {}
"""Config section (``model.<section>``) -> options dataclass, in registration order."""
ARCHS: dict[str, Arch] = {}
"""``model.arch`` preset name -> the variant of each role."""


def register(name: str, *, options: type | None = None, section: str | None = None,
             archs: dict[str, Arch] | None = None) -> Callable[[type], type]:
    """Class decorator: register an attention class as ``name``, its ``options`` dataclass
    as config section ``section`` (default: ``name``; variants may share a section) and its
    architecture presets. Registering a taken name, section or preset is an error."""
    section = section or name

    def decorate(cls: type) -> type:
        if name in REGISTRY or name == "none":
            raise ValueError(f"attention '{name}' is already registered")
        clashes = sorted(set(archs or {}) & set(ARCHS))
        if clashes:
            raise ValueError(f"architecture preset(s) {clashes} already registered")
        if options is not None and SECTIONS.get(section, options) is not options:
            raise ValueError(f"config section model.{section} already holds "
                             f"{SECTIONS[section].__name__}")
        REGISTRY[name] = cls
        cls.options_section = section if options is not None else None
        if options is not None:
            SECTIONS[section] = options
        ARCHS.update(archs or {})
        return cls

    return decorate


def unregister(name: str) -> None:
    """Remove variant ``name``, its presets and (if no other variant uses it) its section:
    for tests that register a variant of their own."""
    cls = REGISTRY.pop(name)
    for arch in [a for a, spec in ARCHS.items() if name in (spec.encoder_self,
                                                            spec.decoder_self, spec.cross)]:
        del ARCHS[arch]
    section = getattr(cls, "options_section", None)
    if section and all(getattr(c, "options_section", None) != section for c in REGISTRY.values()):
        SECTIONS.pop(section, None)


def check_name(name: str, role: str) -> type:
    """The class registered as ``name`` (error if unknown or not usable for ``role``)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown attention '{name}' for {role}; registered: {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    allowed = getattr(cls, "roles", ROLES)
    if role not in allowed:
        raise ValueError(f"attention '{name}' cannot be used for {role} (only {allowed})")
    return cls


def names_for(role: str) -> list[str]:
    """The registered variant names that may fill ``role``, in registration order."""
    return [name for name, cls in REGISTRY.items() if role in getattr(cls, "roles", ROLES)]


def check_dropout(value: float, name: str = "attention_dropout") -> None:
    """For options' ``validate``: a dropout probability is in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1)")


def default_options() -> dict[str, Any]:
    """A fresh options object of every registered section (``ModelConfig``'s defaults)."""
    return {section: options() for section, options in SECTIONS.items()}
