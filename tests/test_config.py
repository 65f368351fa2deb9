"""Config: presets, overrides, errors, and the round trip through a checkpoint."""

from __future__ import annotations

import pytest

from ranmt.checkpoint import load_checkpoint, save_checkpoint
from ranmt.config import ConfigError, load_config, parse_duration, to_dict
from ranmt.model import build_model


def test_presets_set_sizes():
    small = load_config(None, ["model.preset=small"]).model
    assert (small.d_model, small.encoder.layers, small.decoder.layers, small.heads,
            small.ffn_dim) == (256, 3, 3, 4, 1024)
    base = load_config(None, ["model.preset=base"]).model
    assert (base.d_model, base.encoder.layers, base.heads, base.ffn_dim) == (512, 6, 8, 2048)


def test_override_beats_preset_and_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: small\n  d_model: 128\ntrain:\n  lr: 0.01\n")
    cfg = load_config(path, ["model.d_model=64", "train.adam_betas=0.8,0.9"])
    assert cfg.model.d_model == 64  # CLI beats file, file beats preset
    assert cfg.model.encoder.layers == 3  # from the preset
    assert cfg.train.lr == 0.01
    assert cfg.train.adam_betas == (0.8, 0.9)


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError, match="did you mean model.dropout"):
        load_config(None, ["model.dropot=0.1"])


@pytest.mark.parametrize("item", ["train.max_steps=abc", "model.d_model=1.5",
                                  "train.tensorboard=maybe", "model.heads=3"])
def test_bad_values_are_errors(item):
    with pytest.raises(ConfigError):
        load_config(None, [item])


def test_durations():
    assert parse_duration("30m") == 1800
    assert parse_duration("2h") == 7200
    assert parse_duration("90") == 90
    with pytest.raises(ConfigError):
        parse_duration("soon")


def test_config_round_trip_through_checkpoint(tmp_path):
    cfg = load_config(None, ["model.preset=tiny", "model.src_vocab_size=30",
                             "model.tgt_vocab_size=30", "model.norm=post",
                             "model.positions=learned", "decode.beam=3", "train.seed=7"])
    model = build_model(cfg.model)
    vocab = tmp_path / "v.model"
    vocab.write_bytes(b"not used by load_checkpoint")
    save_checkpoint(tmp_path / "ckpt", model, cfg, {"src": vocab, "tgt": vocab})
    loaded, loaded_cfg, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert to_dict(loaded_cfg) == to_dict(cfg)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert a.shape == b.shape and bool((a == b).all()), name
