"""Export to CTranslate2: the converted model scores sentences with ranmt's log-probabilities,
and its greedy search finds ranmt's greedy translation."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.data.corpus import load_meta
from ranmt.inference.decode import greedy_search
from ranmt.inference.export import ExportError, export_ctranslate2
from ranmt.model import BOS_ID, EOS_ID, build_model

ctranslate2 = pytest.importorskip("ctranslate2")


def _checkpoint(reverse_data, tmp_path, **extra):
    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"], **extra})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # non-trivial layer norms and biases, so a wrong mapping cannot hide
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    save_checkpoint(tmp_path / "ckpt", model, cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    return model


@pytest.mark.parametrize("extra", [
    {"model.norm": "pre"},
    {"model.norm": "post", "model.activation": "gelu"},
    {"model.norm": "pre", "model.positions": "learned", "model.tie_output": False,
     "model.share_embeddings": False},
], ids=["pre-norm", "post-norm-gelu", "learned-untied"])
def test_ctranslate2_scores_equal_ranmt_logprobs(reverse_data, tmp_path, extra):
    model = _checkpoint(reverse_data, tmp_path, **extra)
    out = export_ctranslate2(tmp_path / "ckpt", tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out), device="cpu")
    src_ids = [[5, 9, 12, 7], [8, 6, 10, 11, 13, 5]]
    tgt_ids = [[7, 12, 9, 5], [5, 13, 11, 10]]
    src_vocab = _pieces(reverse_data, "src")
    tgt_vocab = _pieces(reverse_data, "tgt")
    results = translator.score_batch([[src_vocab[i] for i in s] for s in src_ids],
                                     [[tgt_vocab[i] for i in t] for t in tgt_ids])
    for src, tgt, result in zip(src_ids, tgt_ids, results):
        with torch.no_grad():
            logits = model(torch.tensor([src + [EOS_ID]]), torch.tensor([[BOS_ID] + tgt]))
            logprobs = torch.log_softmax(logits[0].float(), -1)
            gold = torch.tensor(tgt + [EOS_ID])
            ours = logprobs.gather(1, gold[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.log_probs), ours, atol=1e-4, rtol=1e-4)

    # Greedy search in both finds the same tokens (same length cap: 1.2 |src| + 10).
    for src in src_ids:
        ours = greedy_search(model, torch.tensor([src + [EOS_ID]]), max_len_a=1.2,
                             max_len_b=10)[0][0][0]
        theirs = translator.translate_batch([[src_vocab[i] for i in src]], beam_size=1,
                                            max_decoding_length=int(1.2 * len(src) + 10))
        assert [tgt_vocab.index(p) for p in theirs[0].hypotheses[0]] == ours


def _pieces(data, side):
    from ranmt.data.vocab import Vocab

    processor = Vocab(data / f"spm.{side}.model").processor
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def test_ran_models_are_refused(reverse_data, tmp_path):
    _checkpoint(reverse_data, tmp_path, **{"model.arch": "ran-all"})
    with pytest.raises(ExportError, match="dot-product"):
        export_ctranslate2(tmp_path / "ckpt", tmp_path / "ct2")


def test_the_shortlist_is_exported_as_ctranslate2s_vocabulary_map(reverse_data, tmp_path):
    """A run's lexical shortlist goes into the export as vmap.txt (CTranslate2's vocabulary
    map); read back it is the same shortlist; CTranslate2's greedy search with use_vmap
    finds ranmt's greedy translation with the shortlist."""
    from ranmt.data.batching import pad_sources
    from ranmt.inference.shortlist import (
        SHORTLIST_FILE,
        RestrictedOutput,
        Shortlist,
        build_shortlist,
    )

    model = _checkpoint(reverse_data, tmp_path)
    shortlist = build_shortlist(reverse_data, k=5, frequent=3)
    shortlist.save(tmp_path / "ckpt" / SHORTLIST_FILE, {"k": 5, "frequent": 3})
    out = export_ctranslate2(tmp_path / "ckpt", tmp_path / "ct2")
    src_vocab, tgt_vocab = _pieces(reverse_data, "src"), _pieces(reverse_data, "tgt")
    back = Shortlist.read_vmap(out / "vmap.txt", src_vocab, tgt_vocab)
    assert back.frequent.tolist() == shortlist.frequent.tolist()
    rows = [row[row >= 0].tolist() for row in shortlist.candidates]
    assert [row[row >= 0].tolist() for row in back.candidates] == \
        [[] if source < 4 else row for source, row in enumerate(rows)]
    assert sum(map(len, rows[4:])) > 20  # a list worth the name

    translator = ctranslate2.Translator(str(out), device="cpu")
    for src in ([5, 9, 12, 7], [8, 6, 10, 11, 13, 5], [14, 15, 5]):
        batch = pad_sources([src])
        vocabulary = shortlist.vocabulary(batch)
        ours = greedy_search(RestrictedOutput(model, vocabulary), batch, max_len_a=1.2,
                             max_len_b=10)[0][0][0]
        theirs = translator.translate_batch([[src_vocab[i] for i in src]], beam_size=1,
                                            max_decoding_length=int(1.2 * len(src) + 10),
                                            use_vmap=True)
        assert [tgt_vocab.index(p) for p in theirs[0].hypotheses[0]] == \
            vocabulary[ours].tolist()


def test_a_vocabulary_map_with_an_n_gram_rule_is_refused(tmp_path):
    from ranmt.inference.shortlist import Shortlist

    (tmp_path / "vmap.txt").write_text("\ta\nx y\tb\n")
    with pytest.raises(ValueError, match=r"vmap.txt:2: source 'x y' is not one piece"):
        Shortlist.read_vmap(tmp_path / "vmap.txt", ["x", "y"], ["a", "b"])
