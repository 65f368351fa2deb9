"""benchmarks/peers.py decode: ranmt, CTranslate2 and HF generate decode one tiny post-norm
TransF with the same settings, so their outputs agree and the ratios compare like work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from conftest import load_script, tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.data.corpus import load_meta
from ranmt.model import build_model
from ranmt.runtime.precision import cpu_bf16_support

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")


def _peers():
    return load_script("benchmarks/peers.py")


def _tiny_post_norm_checkpoint(reverse_data, path):
    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"], "model.norm": "post"})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # a random model with a strong EOS bias ends its outputs early
        model.decoder.embedder.tokens.weight[3].mul_(3.0)
    save_checkpoint(path, model, cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    return path


def _args(reverse_data, tmp_path, **overrides):
    values = dict(transf=str(_tiny_post_norm_checkpoint(reverse_data, tmp_path / "ckpt")),
                  ran=None, data=str(reverse_data), split="test", sentences=24, batch=8,
                  beam=3, lenpen=0.6, max_len=12, repeats=1, threads=1,
                  out=str(tmp_path / "out"), fixed_length=None, int8=False, bf16=False,
                  no_hf=False, json=None, isolate=False, only=None, child_out=None,
                  shortlist=False, compile_step=False, ran_name="RAN-ALL", systems=None,
                  student=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_peers_decode_same_outputs_and_writes_table(reverse_data, tmp_path):
    result = _peers().decode(_args(reverse_data, tmp_path))
    systems = result["systems"]
    assert set(systems) == {"ranmt TransF", "CTranslate2 fp32", "HF generate"}
    for name, row in systems.items():
        assert row["tokens_per_s"] > 0
        assert row["same_output_as_ranmt_transf"] == 1.0, name
    assert systems["ranmt TransF"]["ratio_to_ranmt_transf"] == 1.0
    saved = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert saved["systems"].keys() == systems.keys()
    assert "| CTranslate2 fp32 |" in (tmp_path / "out" / "decode.md").read_text()


def test_peers_decode_systems_keeps_the_named_ones_beside_the_reference(reverse_data, tmp_path):
    result = _peers().decode(_args(reverse_data, tmp_path, systems="CTranslate2 fp32"))
    assert set(result["systems"]) == {"ranmt TransF", "CTranslate2 fp32"}
    with pytest.raises(SystemExit, match="no system 'CTranslate2 int8'.*there are"):
        _peers().decode(_args(reverse_data, tmp_path, systems="CTranslate2 int8"))


def test_peers_decode_students_run_every_ranmt_system_the_flags_enable(reverse_data, tmp_path):
    """--student NAME=RUN: a further checkpoint decoded like TransF (here the same one, so
    its outputs are TransF's), with its int8 row against CTranslate2's in the ratios."""
    args = _args(reverse_data, tmp_path, int8=True, no_hf=True, fixed_length=5)
    args.student = [f"Twin={args.transf}"]
    result = _peers().decode(args)
    systems = result["systems"]
    assert {"ranmt Twin", "ranmt Twin int8"} <= set(systems)
    assert systems["ranmt Twin"]["same_output_as_ranmt_transf"] == 1.0
    assert "ranmt Twin int8 / CTranslate2 int8" in result["ratios"]
    for bad in (["Twin"], [f"TransF={args.transf}"]):
        args.student = bad
        with pytest.raises(SystemExit, match="--student"):
            _peers().decode(args)


def test_peers_decode_fixed_length_is_exact_in_every_system(reverse_data, tmp_path):
    """--fixed-length L: ranmt (fp32 and int8), CTranslate2 (fp32 and int8) and HF generate
    all write exactly L tokens per sentence, though the model would stop earlier."""
    length = 9
    result = _peers().decode(_args(reverse_data, tmp_path, fixed_length=length, int8=True,
                                   json=str(tmp_path / "peers.json")))
    systems = result["systems"]
    assert set(systems) == {"ranmt TransF", "CTranslate2 fp32", "HF generate",
                            "ranmt TransF int8", "CTranslate2 int8"}
    for name, row in systems.items():
        assert row["output_lengths"] == [length, length], name
    assert systems["CTranslate2 fp32"]["same_output_as_ranmt_transf"] == 1.0
    assert systems["HF generate"]["same_output_as_ranmt_transf"] == 1.0
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert set(saved["tokens_per_s"]) == set(systems)
    assert saved["fixed_length"] == length
    assert "ranmt TransF int8 / CTranslate2 int8" in saved["ratios"]


@pytest.mark.skipif(not cpu_bf16_support()[0], reason="needs a CPU with native bf16")
def test_peers_decode_bf16_rows_against_ctranslate2_int8(reverse_data, tmp_path):
    """--bf16: ranmt's bf16 decoding beside CTranslate2 int8 (added without --int8) and fp32,
    with the ratios the issue asks for; at a fixed length every system writes L tokens."""
    length = 7
    result = _peers().decode(_args(reverse_data, tmp_path, fixed_length=length, bf16=True,
                                   no_hf=True))
    systems = result["systems"]
    assert set(systems) == {"ranmt TransF", "CTranslate2 fp32", "ranmt TransF bf16",
                            "CTranslate2 int8"}
    for name, row in systems.items():
        assert row["output_lengths"] == [length, length], name
    for pair in ("ranmt TransF bf16 / CTranslate2 int8", "ranmt TransF bf16 / CTranslate2 fp32",
                 "ranmt TransF bf16 / ranmt TransF"):
        assert result["ratios"][pair] > 0, pair


def test_peers_decode_isolated_processes_give_the_same_outputs(reverse_data, tmp_path):
    """--isolate: each system and round in its own process; the same outputs (and systems)
    as the one-process measurement, with one timed sample per round."""
    peers = _peers()
    together = peers.decode(_args(reverse_data, tmp_path, no_hf=True, repeats=1))
    apart = peers.decode(_args(reverse_data, tmp_path, no_hf=True, repeats=2, isolate=True))
    assert set(apart["systems"]) == set(together["systems"]) == {"ranmt TransF",
                                                                   "CTranslate2 fp32"}
    for name, row in apart["systems"].items():
        assert len(row["samples"]) == 2, name
        assert row["same_output_as_ranmt_transf"] == 1.0, name
        assert row["output_lengths"] == together["systems"][name]["output_lengths"], name


def test_peers_decode_shortlist_rows_beside_ctranslate2s_vocabulary_map(reverse_data, tmp_path):
    """--shortlist: ranmt with the run's lexical shortlist and CTranslate2 with it as its
    vocabulary map (use_vmap), fp32 and int8, every system writing L tokens at a fixed
    length; greedy, the two restricted searches agree with each other."""
    from ranmt.inference.shortlist import SHORTLIST_FILE, build_shortlist

    length = 6
    args = _args(reverse_data, tmp_path, fixed_length=length, int8=True, shortlist=True,
                 no_hf=True, beam=1)
    build_shortlist(reverse_data, k=4, frequent=2).save(Path(args.transf) / SHORTLIST_FILE,
                                                        {"k": 4, "frequent": 2})
    result = _peers().decode(args)
    systems = result["systems"]
    assert set(systems) == {"ranmt TransF", "CTranslate2 fp32", "ranmt TransF int8",
                            "CTranslate2 int8", "ranmt TransF + shortlist",
                            "CTranslate2 fp32 + vmap", "ranmt TransF int8 + shortlist",
                            "CTranslate2 int8 + vmap"}
    for name, row in systems.items():
        assert row["output_lengths"] == [length, length], name
    # the two restricted greedy searches write the same tokens (each over its batch's list)
    from ranmt.inference.translator import Translator

    peers = _peers()
    translator = Translator.load(args.transf, device="cpu", shortlist=True)
    ours = peers._ranmt_system(translator, 1, 0.6, 12, length)
    theirs = peers._ct2_system(translator, Path(args.out) / "ct2-transf", 1, 0.6, 12, length,
                               1, "float32", use_vmap=True)
    batches = [[[5, 9, 12, 7], [8, 6, 10, 11, 13, 5]], [[14, 15, 5], [6, 7, 8, 9, 10]]]
    assert [ours(batch) for batch in batches] == [theirs(batch) for batch in batches]
    assert systems["ranmt TransF + shortlist"]["same_output_as_ranmt_transf"] == \
        systems["CTranslate2 fp32 + vmap"]["same_output_as_ranmt_transf"]
    for pair in ("ranmt TransF int8 + shortlist / CTranslate2 int8 + vmap",
                 "CTranslate2 int8 + vmap / CTranslate2 int8"):
        assert result["ratios"][pair] > 0, pair
