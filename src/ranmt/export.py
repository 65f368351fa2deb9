"""``ranmt export --format hf-marian``: a TransF checkpoint as a Hugging Face Marian model.

The exported model computes the same logits as ranmt (tested), so it can be decoded by
Hugging Face ``generate`` or converted with CTranslate2's Transformers converter for
speed comparisons. Marian is a post-norm Transformer with sinusoidal positions, scaled
embeddings and shared, tied embeddings, so only ranmt models of that shape export:
``model.norm=post``, sinusoidal positions on both sides, dot-product attention everywhere,
a joint vocabulary with ``share_embeddings`` and ``tie_output``.

Marian lays its sinusoidal features out as [sin... | cos...] where ranmt interleaves them
(sin, cos, sin, cos, ...). Rather than changing either, the export permutes the model
dimension of every tensor on the residual stream (embeddings, the input side of W_q, W_k,
W_v and the first FFN layer, the output side of W_o and the second FFN layer, layer norms):
a consistent permutation of the residual stream leaves the function unchanged, and after
it ranmt's position features sit where Marian puts them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ranmt.checkpoint import load_checkpoint


class ExportError(ValueError):
    pass


def _check_exportable(cfg) -> None:
    m = cfg.model
    problems = []
    if m.norm != "post":
        problems.append("model.norm must be post (Marian is post-norm)")
    for side in ("encoder", "decoder"):
        kind = getattr(m, side).positions or m.positions
        if kind != "sinusoidal":
            problems.append(f"{side} positions must be sinusoidal, not {kind}")
    names = {m.encoder.self_attention, m.decoder.self_attention, m.decoder.cross_attention}
    if names != {"dot"} or m.decoder.cross_attention_layers != "all" \
            or m.decoder.cross_attention_heads not in (0, m.heads):
        problems.append("every attention must be multi-head dot-product (model.arch=transf)")
    if not (m.joint_vocab and m.share_embeddings and m.tie_output and m.ffn):
        problems.append("needs a joint vocabulary with shared, tied embeddings and FFN layers")
    if m.d_model % 2:
        problems.append("model.d_model must be even")
    if problems:
        raise ExportError("cannot export to hf-marian: " + "; ".join(problems))


def residual_permutation(d_model: int) -> torch.Tensor:
    """Index k of the exported residual stream holds ranmt's coordinate perm[k]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_state_dict(model, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """ranmt weights under Marian's names, with the residual stream permuted."""
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def columns(x: torch.Tensor) -> torch.Tensor:  # Linear reading the residual stream
        return x[:, perm].contiguous()

    def rows(x: torch.Tensor) -> torch.Tensor:  # Linear writing to it, and its bias
        return x[perm].contiguous()

    embedding = columns(state["encoder.embedder.tokens.weight"])
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight",
                 "model.decoder.embed_tokens.weight", "lm_head.weight"):
        out[name] = embedding.clone()

    def attention(ours: str, theirs: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{theirs}.{proj}.weight"] = columns(state[f"{ours}.{proj}.weight"])
            out[f"{theirs}.{proj}.bias"] = state[f"{ours}.{proj}.bias"].clone()
        out[f"{theirs}.out_proj.weight"] = rows(state[f"{ours}.out_proj.weight"])
        out[f"{theirs}.out_proj.bias"] = rows(state[f"{ours}.out_proj.bias"])

    def norm(ours: str, theirs: str) -> None:
        out[f"{theirs}.weight"] = rows(state[f"{ours}.norm.weight"])
        out[f"{theirs}.bias"] = rows(state[f"{ours}.norm.bias"])

    def ffn(ours: str, theirs: str) -> None:
        out[f"{theirs}.fc1.weight"] = columns(state[f"{ours}.ffn.fc1.weight"])
        out[f"{theirs}.fc1.bias"] = state[f"{ours}.ffn.fc1.bias"].clone()
        out[f"{theirs}.fc2.weight"] = rows(state[f"{ours}.ffn.fc2.weight"])
        out[f"{theirs}.fc2.bias"] = rows(state[f"{ours}.ffn.fc2.bias"])

    for i in range(len(model.encoder.layers)):
        ours, theirs = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        attention(f"{ours}.self_attention", f"{theirs}.self_attn")
        norm(f"{ours}.attn_sub", f"{theirs}.self_attn_layer_norm")
        ffn(ours, theirs)
        norm(f"{ours}.ffn_sub", f"{theirs}.final_layer_norm")
    for i in range(len(model.decoder.layers)):
        ours, theirs = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        attention(f"{ours}.self_attention", f"{theirs}.self_attn")
        norm(f"{ours}.self_sub", f"{theirs}.self_attn_layer_norm")
        attention(f"{ours}.cross_attention", f"{theirs}.encoder_attn")
        norm(f"{ours}.cross_sub", f"{theirs}.encoder_attn_layer_norm")
        ffn(ours, theirs)
        norm(f"{ours}.ffn_sub", f"{theirs}.final_layer_norm")
    out["final_logits_bias"] = torch.zeros(1, state["encoder.embedder.tokens.weight"].shape[0])
    return out


def build_marian(model, cfg):
    """A ``transformers.MarianMTModel`` with the weights of a ranmt TransF model."""
    try:
        from transformers import MarianConfig, MarianMTModel
    except ImportError:
        raise ExportError("exporting needs Hugging Face transformers: "
                          "pip install 'ranmt[export]'") from None
    _check_exportable(cfg)
    m = cfg.model
    marian_config = MarianConfig(
        vocab_size=m.src_vocab_size, decoder_vocab_size=m.tgt_vocab_size, d_model=m.d_model,
        encoder_layers=m.encoder.layers, decoder_layers=m.decoder.layers,
        encoder_attention_heads=m.heads, decoder_attention_heads=m.heads,
        encoder_ffn_dim=m.ffn_dim, decoder_ffn_dim=m.ffn_dim,
        max_position_embeddings=m.max_positions, activation_function=m.activation,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
        pad_token_id=0, eos_token_id=3, forced_eos_token_id=3, decoder_start_token_id=2,
        bos_token_id=2, share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    marian = MarianMTModel(marian_config)
    state = marian_state_dict(model, residual_permutation(m.d_model))
    missing, unexpected = marian.load_state_dict(state, strict=False)
    missing = [k for k in missing if "embed_positions" not in k]
    if missing or unexpected:
        raise ExportError(f"weight mapping incomplete: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    return marian.eval()


def export_hf_marian(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a Marian model directory (config, safetensors weights, tokenizer files)."""
    model, cfg, _, directory = load_checkpoint(checkpoint)
    marian = build_marian(model, cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marian.save_pretrained(out)
    # MarianTokenizer's files: the SentencePiece models and the id of every piece.
    shutil.copyfile(directory / "spm.src.model", out / "source.spm")
    shutil.copyfile(directory / "spm.tgt.model", out / "target.spm")
    from ranmt.data.vocab import Vocab

    vocab = Vocab(directory / "spm.tgt.model").processor
    pieces = {vocab.id_to_piece(i): i for i in range(vocab.get_piece_size())}
    (out / "vocab.json").write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarianTokenizer", "model_max_length": cfg.model.max_positions,
         "source_lang": "", "target_lang": "", "pad_token": "<pad>", "eos_token": "</s>",
         "unk_token": "<unk>"}), encoding="utf-8")
    return out
