"""Export to a Hugging Face Marian model: the exported model's logits equal ranmt's."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch, tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.inference.export import ExportError, build_marian, export_hf_marian
from ranmt.model import build_model

transformers = pytest.importorskip("transformers")


def _model(**extra):
    cfg = tiny_config(**{"model.norm": "post", **extra})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # non-trivial layer norms, so a wrong mapping cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model, cfg


def test_marian_logits_equal_ranmt_logits():
    model, cfg = _model()
    marian = build_marian(model, cfg)
    src, tgt = random_batch(batch=3)
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = marian(input_ids=src, attention_mask=src.ne(0).long(),
                        decoder_input_ids=tgt).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_export_writes_a_loadable_directory(reverse_data, tmp_path):
    from ranmt.data.corpus import load_meta

    meta = load_meta(reverse_data)
    model, cfg = _model(**{"model.src_vocab_size": meta["src_vocab_size"],
                           "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    save_checkpoint(tmp_path / "ckpt", model, cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    out = export_hf_marian(tmp_path / "ckpt", tmp_path / "hf")
    loaded = transformers.MarianMTModel.from_pretrained(out).eval()
    src, tgt = random_batch(batch=2, vocab=meta["src_vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=src, attention_mask=src.ne(0).long(),
                                          decoder_input_ids=tgt).logits, model(src, tgt),
                                   atol=1e-4, rtol=1e-4)
    assert (out / "source.spm").is_file() and (out / "vocab.json").is_file()


def test_pre_norm_and_ran_models_are_refused():
    model, cfg = _model(**{"model.norm": "pre"})
    with pytest.raises(ExportError, match="post"):
        build_marian(model, cfg)
    model, cfg = _model(**{"model.arch": "ran-all"})
    with pytest.raises(ExportError, match="dot-product"):
        build_marian(model, cfg)
