"""A new attention variant is one file: its class and options dataclass, registered in one
line, are enough for the config keys (``model.toy.*``), an architecture preset, validation,
training, decoding (fast search = reference search) and checkpoints: nothing else in
ranmt is edited. The toy variant here lives only in this test file."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ranmt.attention.base import AttnOutput
from ranmt.attention.dot_product import DotProductAttention
from ranmt.attention.registry import Arch, register, unregister
from ranmt.config import ConfigError, all_keys, load_config


@dataclass
class ToyOptions:
    """Options of the toy variant, config keys ``model.toy.*``."""

    output_scale: float = 1.0
    """Multiplies the attention's output (the same in the full and the incremental path)."""

    def validate(self) -> None:
        if not self.output_scale > 0:
            raise ValueError("output_scale must be > 0")


class ToyAttention(DotProductAttention):
    """Dot-product attention whose output is scaled by ``model.toy.output_scale``."""

    def __init__(self, spec):
        super().__init__(spec)
        self.output_scale = spec.options["toy"].output_scale

    def forward(self, query, memory, **kwargs) -> AttnOutput:
        out = super().forward(query, memory, **kwargs)
        return AttnOutput(out.context * self.output_scale, out.weights, out.state)


@pytest.fixture()
def toy():
    """The toy variant registered for one test (one line), removed afterwards."""
    register("toy", options=ToyOptions, archs={"toy-all": Arch("toy", "toy")})(ToyAttention)
    yield
    unregister("toy")
    assert "model.toy.output_scale" not in all_keys() and "toy" not in _archs()


def _archs() -> dict:
    from ranmt.config import arch_presets

    return arch_presets()


def _overrides(**extra) -> dict:
    return {"model.preset": "tiny", "model.arch": "toy-all", "model.dropout": "0.0",
            "train.lr": "0.003", "train.warmup_steps": "20", "train.max_time": "0",
            "train.max_steps": "40", "train.validate_every": "40",
            "train.valid_max_sentences": "20", "train.progress": "false",
            "train.tensorboard": "false", "data.max_tokens": "800", **extra}


def test_the_config_knows_a_registered_variant(toy):
    cfg = load_config(None, {"model.arch": "toy-all", "model.toy.output_scale": "0.5"})
    assert cfg.model.toy.output_scale == 0.5
    assert (cfg.model.encoder.self_attention, cfg.model.decoder.self_attention,
            cfg.model.decoder.cross_attention) == ("toy", "toy", "dot")
    assert "model.toy.output_scale" in all_keys()
    with pytest.raises(ConfigError, match="model.toy.output_scale must be > 0"):
        load_config(None, {"model.arch": "toy-all", "model.toy.output_scale": "0"})
    with pytest.raises(ConfigError, match="unknown config key 'model.toy.scale'"):
        load_config(None, {"model.toy.scale": "2"})
    with pytest.raises(ConfigError, match="cannot be used for cross"):  # the class's roles
        ToyAttention.roles = ("encoder_self", "decoder_self")
        try:
            load_config(None, {"model.decoder.cross_attention": "toy"})
        finally:
            del ToyAttention.roles


def test_a_registered_variant_trains_decodes_and_round_trips(toy, reverse_data, tmp_path):
    from ranmt.checkpoint import load_checkpoint
    from ranmt.inference.decode import beam_search, beam_search_reference
    from ranmt.model import build_model
    from ranmt.training.train import train

    cfg = load_config(None, _overrides(**{"model.toy.output_scale": "0.5"}))
    summary = train(cfg, reverse_data, tmp_path / "run")
    assert summary["steps"] == 40
    model, loaded, _, _ = load_checkpoint(tmp_path / "run")
    assert loaded.model.toy.output_scale == 0.5 and loaded.model.arch == "toy-all"
    toy_modules = [m for m in model.modules() if isinstance(m, ToyAttention)]
    assert len(toy_modules) == 2 * 2 and all(m.output_scale == 0.5 for m in toy_modules)

    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 11, 3, 0]])  # EOS 3, PAD 0
    fast = beam_search(model, src, beam=3)
    reference = beam_search_reference(model, src, beam=3)
    assert [[tokens for tokens, _ in hyps] for hyps in fast] == \
        [[tokens for tokens, _ in hyps] for hyps in reference]

    # The option reaches the modules: the same weights under output_scale 1 decode otherwise.
    unscaled = build_model(load_config(None, {**_overrides(), **{
        "model.src_vocab_size": str(loaded.model.src_vocab_size),
        "model.tgt_vocab_size": str(loaded.model.tgt_vocab_size),
        "model.joint_vocab": str(loaded.model.joint_vocab)}}).model)
    unscaled.load_state_dict(model.state_dict())
    unscaled.eval()
    tgt = torch.tensor([[2, 5, 6], [2, 9, 10]])  # BOS 2
    with torch.no_grad():
        assert not torch.allclose(model(src, tgt), unscaled(src, tgt))
