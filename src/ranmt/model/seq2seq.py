"""The encoder-decoder model and ``build_model(cfg)``, the only reader of the model config.

Shapes: src (B, S), tgt_in (B, T) token ids; memory (B, S, d); logits (B, T, V).
Cross-layer attention state (e.g. RAN's ``A_l``) is passed explicitly up each stack: the
first layer receives ``initial_state()`` of its attention and each layer returns the
state for the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ranmt.attention import AttentionSpec, build_attention, build_shared, reorder_cache
from ranmt.attention.base import PassMasks, whole_span_plan
from ranmt.attention.cache import AttentionCache, DecoderCache, LayerCache
from ranmt.config import ModelConfig
from ranmt.model.layers import DecoderLayer, Embedder, EncoderLayer, FeedForward, build_positions
from ranmt.runtime.int8 import int8_product
from ranmt.runtime.packed import inference_linear, use_packed_linears

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Encoder(nn.Module):
    def __init__(self, embedder: Embedder, layers: list[EncoderLayer], final_norm: nn.Module):
        super().__init__()
        self.embedder = embedder
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def initial_state(self) -> Any:
        attention = self.layers[0].self_attention
        return attention.initial_state() if attention is not None else None

    def forward(self, src: Tensor, pad_mask: Tensor, need_weights: bool = False,
                masks: PassMasks | None = None):
        """src (B, S), pad_mask (B, S) -> memory (B, S, d), list of per-layer weights.
        ``masks``: the pass's shared masks (a new set when None)."""
        masks = PassMasks() if masks is None else masks
        x = self.embedder(src)
        state = self.initial_state()
        all_weights = []
        for layer in self.layers:
            x, state, weights = layer(x, pad_mask, state, need_weights, masks)
            all_weights.append(weights)
        return self.final_norm(x), all_weights


class RestrictedProjection:
    """An output layer's rows for a compiled step's shortlist: x (..., d) -> logits
    (..., V'), with ``weight`` (V', d) float, or ``weight`` (d, V') int8 and
    ``weight_scale`` (V',) (``ranmt.runtime.int8.int8_product``); ``bias`` (V',)
    holds -inf at the padding rows. Plain tensors, so a compiled graph takes them as inputs
    (not constants): a new batch of the same size runs the same graph."""

    def __init__(self, weight: Tensor, weight_scale: Tensor | None, bias: Tensor):
        self.weight, self.weight_scale, self.bias = weight, weight_scale, bias

    def __call__(self, x: Tensor) -> Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
        return int8_product(x, self.weight, self.weight_scale, self.bias)


class Decoder(nn.Module):
    def __init__(self, embedder: Embedder, layers: list[DecoderLayer], final_norm: nn.Module,
                 output: nn.Linear | None):
        super().__init__()
        self.embedder = embedder
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.output = output  # None: tied to the target embedding
        self._packed: dict = {}  # the tied output weight packed for inference

    def initial_states(self) -> tuple[Any, Any]:
        first = self.layers[0]
        self_state = first.self_attention.initial_state() if first.self_attention else None
        cross_state = None
        for layer in self.layers:  # SH-X-like stacks may lack cross-attention in layer 0
            if layer.cross_attention is not None:
                cross_state = layer.cross_attention.initial_state()
                break
        return self_state, cross_state

    def _float_rows(self, vocabulary: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """(weight (V', d), bias (V',) or None) of a tied or linear output layer at the ids
        ``vocabulary``; None for another kind of layer."""
        if self.output is not None and not isinstance(self.output, nn.Linear):
            return None
        source = self.embedder.tokens if self.output is None else self.output
        bias = getattr(source, "bias", None)
        return (source.weight.index_select(0, vocabulary),
                None if bias is None else bias.index_select(0, vocabulary))

    def restricted_output(self, vocabulary: Tensor) -> Callable[[Tensor], Tensor]:
        """The output layer restricted to the target ids ``vocabulary`` (V',): a function
        (..., d) -> logits (..., V') equal to the full layer's logits at those ids. Its
        weight rows are taken once and, at inference on a CPU, packed once (oneDNN for
        float32, :func:`ranmt.runtime.packed.inference_linear`; fbgemm for an int8 layer,
        whose rows keep their int8 values and scale, so the logits are the full int8
        layer's exactly); another kind of output layer computes the full product and
        slices it."""
        rows = self._float_rows(vocabulary)
        if rows is not None:  # tied, or a linear
            weight, bias = rows
            packed: dict = {}
            if self.training:
                return lambda x: F.linear(x, weight, bias)
            return lambda x: inference_linear(x, weight, bias, packed, "restricted")
        restricted = getattr(self.output, "restricted", None)  # an int8 layer's own rows
        if restricted is not None:
            return restricted(vocabulary)
        return lambda x: self.output(x).index_select(-1, vocabulary)

    def restricted_projection(self, vocabulary: Tensor, blocked: int
                              ) -> RestrictedProjection:
        """The output layer at the ids ``vocabulary`` (V',) whose last ``blocked`` entries
        are padding (logits -inf), as plain tensors for a compiled step: float rows (tied
        or linear) or an int8 layer's rows and scales (traced as ``torch._int_mm``)."""
        rows = self._float_rows(vocabulary)
        if rows is not None:
            (weight, bias), weight_scale = rows, None
            weight = weight.detach()
        elif hasattr(self.output, "weight_t"):  # ranmt.inference.quantize.Int8Linear
            weight = self.output.rows_t(vocabulary)  # (d, V') int8
            weight_scale = self.output.weight_scale.index_select(0, vocabulary)
            bias = self.output.bias
            bias = None if bias is None else bias.index_select(0, vocabulary)
        else:
            raise ValueError(f"a compiled shortlist cannot restrict a "
                             f"{type(self.output).__name__} output layer")
        bias = (torch.zeros(len(vocabulary), device=vocabulary.device) if bias is None
                else bias.detach().float())
        bias[len(vocabulary) - blocked:] = float("-inf")
        return RestrictedProjection(weight, weight_scale, bias)

    def project(self, x: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """(B, T, d) -> logits (B, T, V), or (B, T, V') over ``cache.vocabulary``."""
        if cache is not None and cache.vocabulary is not None:
            if cache.output is None:
                cache.output = self.restricted_output(cache.vocabulary)
            return cache.output(x)
        if self.output is None:
            if self.training:
                return F.linear(x, self.embedder.tokens.weight)
            return inference_linear(x, self.embedder.tokens.weight, None, self._packed,
                                    "output")
        return self.output(x)

    def forward(self, tgt_in: Tensor, memory: Tensor, src_pad_mask: Tensor,
                cache: DecoderCache | None = None, need_weights: bool = False,
                masks: PassMasks | None = None):
        """tgt_in (B, T) -> logits (B, T, V), per-layer weight dicts.

        With ``cache`` (incremental decoding) ``tgt_in`` is (B, 1) at position ``cache.step``,
        or, when ``cache.positions`` (B,) is set (step-level batching), row r at position
        ``positions[r]`` (``cache.span``: the largest position + 1). ``masks``: the pass's
        shared masks (a new set when None).
        """
        masks = PassMasks() if masks is None else masks
        if cache is not None and cache.vocabulary is not None:
            tgt_in = cache.vocabulary[tgt_in]  # shortlist indices -> target ids
        positions = None if cache is None else cache.positions
        offset = 0 if cache is None else cache.step if positions is None else positions
        x = self.embedder(tgt_in, offset, None if positions is None else cache.span)
        self_state, cross_state = self.initial_states()
        all_weights = []
        for index, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None:
                layer_cache = cache.layers[index]
                for part in (layer_cache.self_attention, layer_cache.cross_attention):
                    part.step = cache.step
                    part.positions, part.span = positions, cache.span
            x, self_state, cross_state, weights = layer(
                x, memory, src_pad_mask, self_state, cross_state, layer_cache, need_weights,
                masks)
            all_weights.append(weights)
        return self.project(self.final_norm(x), cache), all_weights


class Seq2Seq(nn.Module):
    """Encoder-decoder Transformer with pluggable attention."""

    def __init__(self, encoder: Encoder, decoder: Decoder, config: ModelConfig):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.config = config
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

    def encode(self, src: Tensor, need_weights: bool = False, masks: PassMasks | None = None):
        """src (B, S) -> memory (B, S, d), pad mask (B, S), encoder weights."""
        pad_mask = src.eq(self.pad_id)
        memory, weights = self.encoder(src, pad_mask, need_weights, masks)
        return memory, pad_mask, weights

    def forward(self, src: Tensor, tgt_in: Tensor, need_weights: bool = False):
        """Teacher-forced pass: src (B, S), tgt_in (B, T) -> logits (B, T, V).

        With ``need_weights`` returns ``(logits, {"encoder": [...], "decoder": [...]})``.
        One set of masks serves both stacks (the source's padding mask is the same).
        """
        masks = PassMasks()
        memory, pad_mask, enc_weights = self.encode(src, need_weights, masks)
        logits, dec_weights = self.decoder(tgt_in, memory, pad_mask, need_weights=need_weights,
                                           masks=masks)
        if need_weights:
            return logits, {"encoder": enc_weights, "decoder": dec_weights}
        return logits

    # ---------------------------------------------------------------- incremental decoding
    def init_cache(self, memory: Tensor, pad_mask: Tensor, group: int = 1,
                   capacity: int | None = None) -> DecoderCache:
        """Decoder cache for ``group`` consecutive query rows per sentence of memory (n, S, d).

        With ``capacity`` (the fast decoder: the most steps the search will take) per-step
        histories live in buffers of that length allocated once and written in place, and
        the projections of a step are fused; without it they grow step by step (reference).

        With ``group`` g > 1 (beam search) and cross-attention that supports it
        (``Attention.grouped_memory``), the memory side stays per sentence: n rows of memory
        serve n * g decoder rows. Otherwise the memory is expanded to n * g rows here.
        """
        grouped = group > 1 and all(layer.cross_attention is None
                                    or layer.cross_attention.grouped_memory
                                    for layer in self.decoder.layers)
        if group > 1 and not grouped:
            expand = torch.arange(memory.shape[0], device=memory.device).repeat_interleave(group)
            memory, pad_mask = memory.index_select(0, expand), pad_mask.index_select(0, expand)
        capacity = capacity or None
        return DecoderCache(
            memory=memory, pad_mask=pad_mask, group=group if grouped else 1,
            layers=[LayerCache(AttentionCache(capacity), AttentionCache(capacity))
                    for _ in self.decoder.layers])

    def decode_step(self, prev_tokens: Tensor, cache: DecoderCache) -> Tensor:
        """prev_tokens (B, 1) at position ``cache.step`` -> log-probs (B, V) (float32)."""
        logits, _ = self.decoder(prev_tokens, cache.memory, cache.pad_mask, cache=cache)
        cache.step += 1
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    @staticmethod
    def reorder_cache(cache: DecoderCache, order: Tensor, within_groups: bool = False) -> None:
        """Keep decoder rows ``order`` (1-D long; may repeat or shrink) of a decoder cache.

        In a grouped cache (``cache.group`` g > 1) rows come in groups of g that belong
        to one sentence (``order[j*g:(j+1)*g] // g`` all equal); the memory side is then
        reordered by sentence, and only when the set of sentences changes.
        ``within_groups``: the caller guarantees that group j of ``order`` takes its rows
        from group j (every sentence keeps its place: the sync-free search); nothing is
        checked (no host sync) and the memory side is not touched.
        """
        group = cache.group
        sentence_order = order
        if within_groups and group > 1:
            sentence_order = None
        elif group > 1:
            if order.numel() % group:
                raise ValueError(f"a grouped cache keeps rows in groups of {group}, "
                                 f"got {order.numel()} rows")
            by_group = torch.div(order.view(-1, group), group, rounding_mode="floor")
            sentence_order = by_group[:, 0]
            if not bool((by_group == sentence_order[:, None]).all()):
                raise ValueError("a grouped cache needs every group of rows from one sentence")
            if sentence_order.numel() == cache.memory.shape[0] and bool(
                    (sentence_order == torch.arange(sentence_order.numel(),
                                                    device=order.device)).all()):
                sentence_order = None  # same sentences, same order: nothing to copy
        if sentence_order is not None:
            cache.memory = cache.memory.index_select(0, sentence_order)
            cache.pad_mask = cache.pad_mask.index_select(0, sentence_order)
        # Rows at their own positions (step-level batching): histories gathered by the
        # cache's plan (each row's written slots), or into span + 1 slots; not where every
        # sentence keeps its place (the sync-free search, CUDA graphs), whose histories
        # keep their shape.
        plan = None
        if cache.positions is not None and not within_groups:
            plan = cache.plan or whole_span_plan(order.numel(), cache.span)
            cache.plan = None
        for layer_cache in cache.layers:
            reorder_cache(layer_cache.self_attention, order, plan)
            if group == 1:
                reorder_cache(layer_cache.cross_attention, order)
            elif sentence_order is not None:
                reorder_cache(layer_cache.cross_attention, sentence_order)


def component_weights(weights: dict) -> dict[str, list]:
    """``Seq2Seq.forward(..., need_weights=True)``'s weights by component: ``encoder_self``,
    ``decoder_self`` and ``cross``, each a list over layers of (B, H, queries, keys) tensors
    (None for a layer without that component)."""
    return {
        "encoder_self": list(weights["encoder"]),
        "decoder_self": [layer.get("self") for layer in weights["decoder"]],
        "cross": [layer.get("cross") for layer in weights["decoder"]],
    }


def _positions_kind(model_default: str, override: str) -> str:
    return override or model_default


def build_model(cfg: ModelConfig) -> Seq2Seq:
    """Build the model described by ``cfg`` (vocabulary sizes included)."""
    if cfg.src_vocab_size <= 0 or cfg.tgt_vocab_size <= 0:
        raise ValueError("model.src_vocab_size / model.tgt_vocab_size are not set "
                         "(they come from the prepared data)")
    d = cfg.d_model
    pre_norm = cfg.norm == "pre"

    def embedding(size: int) -> nn.Embedding:
        emb = nn.Embedding(size, d, padding_idx=PAD_ID)
        nn.init.normal_(emb.weight, std=d ** -0.5)
        with torch.no_grad():
            emb.weight[PAD_ID].zero_()
        return emb

    src_tokens = embedding(cfg.src_vocab_size)
    share = cfg.share_embeddings and cfg.joint_vocab and cfg.src_vocab_size == cfg.tgt_vocab_size
    tgt_tokens = src_tokens if share else embedding(cfg.tgt_vocab_size)

    options = cfg.variant_options  # section -> options of every registered variant

    def attention_dropout(role: str) -> float:
        if role == "cross" and cfg.cross_attention_dropout >= 0:
            return cfg.cross_attention_dropout
        return cfg.attention_dropout

    def spec(role: str, index: int, layers: int, shared: Any, heads: int = 0) -> AttentionSpec:
        return AttentionSpec(d_model=d, heads=heads or cfg.heads,
                             dropout=attention_dropout(role), max_positions=cfg.max_positions,
                             role=role, layer_index=index, num_layers=layers, shared=shared,
                             options=options, ffn_dim=cfg.ffn_dim)

    def attention_stack(name: str, role: str, layers: int, present, heads: int = 0) -> list:
        """One attention module per layer (None where the layer has none)."""
        if name == "none":
            return [None] * layers
        shared = build_shared(name, role, spec(role, 0, layers, None, heads))
        return [build_attention(name, spec(role, i, layers, shared, heads)) if present(i)
                else None for i in range(layers)]

    def ffn() -> FeedForward | None:
        if not cfg.ffn:
            return None
        return FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)

    enc_layers, dec_layers = cfg.encoder.layers, cfg.decoder.layers
    encoder_layers = [
        EncoderLayer(attention, ffn(), d, cfg.dropout, pre_norm)
        for attention in attention_stack(cfg.encoder.self_attention, "encoder_self", enc_layers,
                                         lambda i: True)
    ]
    if cfg.decoder.cross_attention_layers == "last":
        has_cross = lambda i: i == dec_layers - 1  # noqa: E731  (SH-X)
    else:
        has_cross = lambda i: True  # noqa: E731
    decoder_layers = [
        DecoderLayer(self_attention, cross_attention, ffn(), d, cfg.dropout, pre_norm)
        for self_attention, cross_attention in zip(
            attention_stack(cfg.decoder.self_attention, "decoder_self", dec_layers,
                            lambda i: True),
            attention_stack(cfg.decoder.cross_attention, "cross", dec_layers, has_cross,
                            cfg.decoder.cross_attention_heads))
    ]

    def final_norm() -> nn.Module:
        return nn.LayerNorm(d) if pre_norm else nn.Identity()

    encoder = Encoder(
        Embedder(src_tokens, build_positions(_positions_kind(cfg.positions, cfg.encoder.positions),
                                             d, cfg.max_positions), cfg.dropout),
        encoder_layers, final_norm())
    output = None
    if not cfg.tie_output:
        output = nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        nn.init.normal_(output.weight, std=d ** -0.5)
    decoder = Decoder(
        Embedder(tgt_tokens, build_positions(_positions_kind(cfg.positions, cfg.decoder.positions),
                                             d, cfg.max_positions), cfg.dropout),
        decoder_layers, final_norm(), output)
    # Linear layers run through oneDNN with prepacked weights at CPU inference (packed.py).
    return use_packed_linears(Seq2Seq(encoder, decoder, cfg))


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Trainable parameter counts: ``total`` and per component (shared tensors counted once).

    Components: ``embeddings`` (token embeddings and untied output), ``encoder.self_attention``,
    ``decoder.self_attention``, ``decoder.cross_attention``, ``encoder.ffn``, ``decoder.ffn``,
    ``encoder.other`` / ``decoder.other`` (layer norms, learned positions). A stack-wide
    module shared by the layers (RAN's A_0 and transition) counts once, under its stack.
    """
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():  # yields each shared tensor once
        if not param.requires_grad:
            continue
        stack = name.split(".")[0]
        if ".tokens." in name or stack == "output" or name.startswith("decoder.output"):
            component = "embeddings"
        elif ".cross_attention." in name:
            component = "decoder.cross_attention"
        elif ".self_attention." in name:
            component = f"{stack}.self_attention"
        elif ".ffn." in name:
            component = f"{stack}.ffn"
        else:
            component = f"{stack}.other"
        counts[component] = counts.get(component, 0) + param.numel()
    ordered = dict(sorted(counts.items()))
    ordered["total"] = sum(counts.values())
    return ordered
