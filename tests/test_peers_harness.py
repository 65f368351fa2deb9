"""benchmarks/peers.py decode: ranmt, CTranslate2 and HF generate decode one tiny post-norm
TransF with the same settings, so their outputs agree and the ratios compare like work."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.data.corpus import load_meta
from ranmt.model import build_model

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peers_decode_same_outputs_and_writes_table(reverse_data, tmp_path):
    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"], "model.norm": "post"})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # a random model with a strong EOS bias ends its outputs early
        model.decoder.embedder.tokens.weight[3].mul_(3.0)
    save_checkpoint(tmp_path / "ckpt", model, cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    args = argparse.Namespace(transf=str(tmp_path / "ckpt"), ran=None, data=str(reverse_data),
                              split="test", sentences=24, batch=8, beam=3, lenpen=0.6,
                              max_len=12, repeats=1, threads=1, out=str(tmp_path / "out"))
    result = _peers().decode(args)
    systems = result["systems"]
    assert set(systems) == {"ranmt TransF", "CTranslate2 fp32", "HF generate"}
    for name, row in systems.items():
        assert row["tokens_per_s"] > 0
        assert row["same_output_as_ranmt_transf"] == 1.0, name
    assert systems["ranmt TransF"]["ratio_to_ranmt_transf"] == 1.0
    saved = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert saved["systems"].keys() == systems.keys()
    assert "| CTranslate2 fp32 |" in (tmp_path / "out" / "decode.md").read_text()
