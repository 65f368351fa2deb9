"""``ranmt export``: a TransF checkpoint as a Hugging Face Marian model or a CTranslate2 model.

``--format ctranslate2`` builds CTranslate2's ``TransformerSpec`` directly from the ranmt
weights, so pre-norm and post-norm models, sinusoidal or learned positions, tied or untied
output all export; the exported model scores sentences with the same log-probabilities as
ranmt (tested). ``--format hf-marian`` is described below.

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


def marian_config(model_config, dropout: float = 0.0, **extra):
    """The ``transformers.MarianConfig`` of a model shaped like ``model_config`` (a ranmt
    ``model`` section): layers, width, heads, FFN, vocabularies, ranmt's special ids;
    ``dropout`` on the residual paths, ``extra`` passed on (e.g. ``attn_implementation``)."""
    try:
        from transformers import MarianConfig
    except ImportError:
        raise ExportError("exporting needs Hugging Face transformers: "
                          "pip install 'ranmt[export]'") from None
    m = model_config
    return MarianConfig(
        vocab_size=m.src_vocab_size, decoder_vocab_size=m.tgt_vocab_size, d_model=m.d_model,
        encoder_layers=m.encoder.layers, decoder_layers=m.decoder.layers,
        encoder_attention_heads=m.heads, decoder_attention_heads=m.heads,
        encoder_ffn_dim=m.ffn_dim, decoder_ffn_dim=m.ffn_dim,
        max_position_embeddings=m.max_positions, activation_function=m.activation,
        dropout=dropout, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
        pad_token_id=0, eos_token_id=3, forced_eos_token_id=3, decoder_start_token_id=2,
        bos_token_id=2, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        **extra)


def build_marian(model, cfg):
    """A ``transformers.MarianMTModel`` with the weights of a ranmt TransF model."""
    config = marian_config(cfg.model)  # ExportError without transformers
    from transformers import MarianMTModel

    _check_exportable(cfg)
    marian = MarianMTModel(config)
    state = marian_state_dict(model, residual_permutation(cfg.model.d_model))
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


# ------------------------------------------------------------------------------ CTranslate2
def _check_ctranslate2_exportable(cfg) -> None:
    m = cfg.model
    problems = []
    names = {m.encoder.self_attention, m.decoder.self_attention, m.decoder.cross_attention}
    if names != {"dot"} or m.decoder.cross_attention_layers != "all" \
            or m.decoder.cross_attention_heads not in (0, m.heads):
        problems.append("every attention must be multi-head dot-product (model.arch=transf)")
    for side in ("encoder", "decoder"):
        if (getattr(m, side).positions or m.positions) == "none":
            problems.append(f"{side} needs position embeddings")
    if not m.ffn:
        problems.append("needs FFN layers")
    if m.activation not in ("relu", "gelu"):
        problems.append(f"activation {m.activation} has no CTranslate2 equivalent")
    if problems:
        raise ExportError("cannot export to ctranslate2: " + "; ".join(problems))


def ctranslate2_spec(model, cfg, src_pieces: list[str], tgt_pieces: list[str]):
    """A ``ctranslate2.specs.TransformerSpec`` holding the weights of a ranmt TransF model."""
    try:
        from ctranslate2.specs import common_spec, transformer_spec
    except ImportError:
        raise ExportError("exporting to CTranslate2 needs it: pip install ctranslate2") from None
    _check_ctranslate2_exportable(cfg)
    m = cfg.model
    activation = {"relu": common_spec.Activation.RELU,
                  "gelu": common_spec.Activation.GELU}[m.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (m.encoder.layers, m.decoder.layers), m.heads, pre_norm=m.norm == "pre",
        activation=activation)

    def weight(t: torch.Tensor):
        return t.detach().float().cpu().numpy().copy()

    def linear(target, module, bias: bool = True) -> None:
        target.weight = weight(module.weight)
        if bias and getattr(module, "bias", None) is not None:
            target.bias = weight(module.bias)

    def fused(target, modules) -> None:  # one Linear computing several projections
        target.weight = weight(torch.cat([mod.weight for mod in modules], 0))
        target.bias = weight(torch.cat([mod.bias for mod in modules], 0))

    def norm(target, layer_norm) -> None:
        target.gamma = weight(layer_norm.weight)
        target.beta = weight(layer_norm.bias)

    def inputs(target, embedder) -> None:
        embeddings = target.embeddings  # the encoder holds a list (several source factors)
        embeddings = embeddings[0] if isinstance(embeddings, list) else embeddings
        embeddings.weight = weight(embedder.tokens.weight)
        target.scale_embeddings = True
        target.position_encodings.encodings = weight(embedder.positions(m.max_positions, 0))

    encoder, decoder = model.encoder, model.decoder
    inputs(spec.encoder, encoder.embedder)
    inputs(spec.decoder, decoder.embedder)
    pre = m.norm == "pre"
    if pre:
        norm(spec.encoder.layer_norm, encoder.final_norm)
        norm(spec.decoder.layer_norm, decoder.final_norm)
    for ours, theirs in zip(encoder.layers, spec.encoder.layer):
        attention = ours.self_attention
        fused(theirs.self_attention.linear[0], [attention.q_proj, attention.k_proj,
                                                attention.v_proj])
        linear(theirs.self_attention.linear[1], attention.out_proj)
        norm(theirs.self_attention.layer_norm, ours.attn_sub.norm)
        linear(theirs.ffn.linear_0, ours.ffn.fc1)
        linear(theirs.ffn.linear_1, ours.ffn.fc2)
        norm(theirs.ffn.layer_norm, ours.ffn_sub.norm)
    for ours, theirs in zip(decoder.layers, spec.decoder.layer):
        attention, cross = ours.self_attention, ours.cross_attention
        fused(theirs.self_attention.linear[0], [attention.q_proj, attention.k_proj,
                                                attention.v_proj])
        linear(theirs.self_attention.linear[1], attention.out_proj)
        norm(theirs.self_attention.layer_norm, ours.self_sub.norm)
        linear(theirs.attention.linear[0], cross.q_proj)
        fused(theirs.attention.linear[1], [cross.k_proj, cross.v_proj])
        linear(theirs.attention.linear[2], cross.out_proj)
        norm(theirs.attention.layer_norm, ours.cross_sub.norm)
        linear(theirs.ffn.linear_0, ours.ffn.fc1)
        linear(theirs.ffn.linear_1, ours.ffn.fc2)
        norm(theirs.ffn.layer_norm, ours.ffn_sub.norm)
    spec.decoder.projection.weight = weight(
        decoder.embedder.tokens.weight if decoder.output is None else decoder.output.weight)
    spec.config.layer_norm_epsilon = encoder.layers[0].ffn_sub.norm.eps
    spec.config.decoder_start_token = tgt_pieces[2]  # BOS
    spec.config.add_source_eos = True  # ranmt's encoder reads the source with EOS
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(tgt_pieces)
    return spec


def export_ctranslate2(checkpoint: str | Path, out: str | Path, quantization: str | None = None
                       ) -> Path:
    """Write a CTranslate2 model directory (model.bin, vocabularies, config.json)."""
    try:
        from ctranslate2.converters.converter import Converter
    except ImportError:
        raise ExportError("exporting to CTranslate2 needs it: pip install ctranslate2") from None
    from ranmt.data.vocab import Vocab
    from ranmt.inference.shortlist import Shortlist, shortlist_beside

    model, cfg, _, directory = load_checkpoint(checkpoint)
    model.eval()

    def pieces(path: Path) -> list[str]:
        processor = Vocab(path).processor
        return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]

    spec = ctranslate2_spec(model, cfg, pieces(directory / "spm.src.model"),
                            pieces(directory / "spm.tgt.model"))

    class _RanmtConverter(Converter):
        def _load(self):
            return spec

    out = Path(out)
    _RanmtConverter().convert(str(out), quantization=quantization, force=True)
    shutil.copyfile(directory / "spm.src.model", out / "source.spm")
    shutil.copyfile(directory / "spm.tgt.model", out / "target.spm")
    shortlist = shortlist_beside(checkpoint)
    if shortlist is not None:  # CTranslate2 reads it with translate_batch(use_vmap=True)
        Shortlist.load(shortlist).write_vmap(out / "vmap.txt", pieces(directory / "spm.src.model"),
                                             pieces(directory / "spm.tgt.model"))
    return out
