"""`ranmt analyze` end to end: every figure is written, non-empty and a valid PNG."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.cli import main
from ranmt.data.corpus import load_meta
from ranmt.model import build_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _checkpoint(data, path, arch):
    meta = load_meta(data)
    cfg = tiny_config(**{"model.arch": arch, "model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    torch.manual_seed(0)
    save_checkpoint(path, build_model(cfg.model), cfg,
                    {"src": data / "spm.src.model", "tgt": data / "spm.tgt.model"})
    return path


def _ran_encoder_entropy(checkpoint, data, count: int) -> list[float]:
    """Paper 000 Eq. 5 per encoder layer, computed from RAN's matrices (not the analysis)."""
    from ranmt.checkpoint import load_checkpoint
    from ranmt.data.corpus import load_split

    model = load_checkpoint(checkpoint)[0].eval()
    lengths = [len(ids) + 1 for ids in load_split(data, "test").src[:count]]
    with torch.no_grad():
        matrices = model.encoder.layers[0].self_attention.shared.matrices()  # [(H, N, N)]
        per_layer = []
        for matrix in matrices:
            total = torch.zeros(matrix.shape[0], dtype=torch.float64)
            for length in lengths:
                probs = torch.softmax(matrix[:, :length, :length].double(), dim=-1)
                total += -(probs * probs.clamp_min(1e-300).log()).sum((1, 2))
            per_layer.append(float((total / sum(lengths)).mean()))
    return per_layer


def test_analyze_writes_every_figure_and_json(reverse_data, tmp_path):
    transf = _checkpoint(reverse_data, tmp_path / "transf", "transf")
    ran = _checkpoint(reverse_data, tmp_path / "ran", "ran-all")
    out = tmp_path / "analysis"
    main(["analyze", "--checkpoint", str(transf), "--checkpoint", str(ran), "--data",
          str(reverse_data), "--split", "test", "--out", str(out), "--max-sentences", "24",
          "--beam", "2", "--device", "cpu", "--layers", "1", "2"])
    result = json.loads((out / "analysis.json").read_text())
    assert [s["label"] for s in result["systems"]] == ["transf", "ran-all"]
    expected = {"entropy.png", "histograms.png", "js_divergence.png", "argmax_distance.png",
                "bleu_by_source_length.png", "bleu_by_reference_length.png",
                "bleu_by_offdiagonality.png", "heatmap_ran-all_encoder_self.png",
                "heatmap_ran-all_decoder_self_heads.png"}
    assert expected <= set(result["figures"])
    for name in result["figures"]:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), name
    ran_stats = result["systems"][1]["attention"]
    # RAN's encoder weights are input-agnostic: a source of S tokens (EOS included) attends
    # with softmax(A_l[h, i, :S]) from each of its S rows, so each layer's entropy is known
    # from the learned matrices alone: the mean over heads of the summed row entropies of the
    # first 24 test sources over their summed lengths. JS of a layer with itself is 0.
    assert ran_stats["encoder_self"]["entropy"] == pytest.approx(
        _ran_encoder_entropy(ran, reverse_data, 24), rel=1e-4)
    assert ran_stats["decoder_self"]["js_divergence"][0][0] == 0.0
    matrices = result["systems"][1]["learned_matrices"]["decoder_self"]
    first = torch.tensor(matrices[0])  # (H, n, n): causal rows summing to one
    torch.testing.assert_close(first.sum(-1), torch.ones(first.shape[:2]), atol=1e-3,
                               rtol=0)
    assert float(first.triu(1).abs().max()) == 0.0
    assert len(result["systems"][0]["attention"]["offdiagonality"]) == 24
