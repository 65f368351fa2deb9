"""Typed configuration: nested dataclasses, YAML files, ``key=value`` overrides, presets.

The whole tree (:class:`Config`) is stored as JSON in every checkpoint and is enough to
rebuild the model with :func:`ranmt.model.build_model`.

Resolution order when a config is loaded (:func:`load_config`):

1. dataclass defaults;
2. the model preset (``model.preset``: ``tiny`` | ``small`` | ``base``) and the
   architecture (``model.arch``), both taken from the overrides if given there,
   else from the YAML file, else the defaults;
3. every other value of the YAML file;
4. every other ``key=value`` override of the command line.

An unknown key is an error that lists the closest valid keys; a value that cannot be
converted to the field's type is an error naming the key, the value and the type.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The choices of the enumerated fields, written once: the field types below are these
# Literals, checked by one rule when a value is set and again by validate() (the closest
# choice is suggested), and modules that act on a choice read their names from here.
Norm = Literal["pre", "post"]
Positions = Literal["sinusoidal", "learned", "none"]
PositionsOverride = Literal["", "sinusoidal", "learned", "none"]  # "": the model's choice
Activation = Literal["relu", "gelu"]
CrossAttentionLayers = Literal["all", "last"]
Precision = Literal["auto", "fp32", "bf16", "bf16-weights", "fp16"]
DropoutMasks = Literal["torch", "fast"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
HostReads = Literal["auto", "step", "log"]
LengthPenaltyStyle = Literal["gnmt", "fairseq"]
Sampling = Literal["none", "topk", "topp", "eps"]
ValidMetric = Literal["bleu", "chrf", "rouge1", "rouge2", "rougeL"]
VALID_METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2",
                      "rougeL": "ROUGE-L", "loss": "-loss"}
"""How logs and tables name the score that picks the best checkpoint (``loss``: the
validation loss, where the validation set is not decoded)."""


class ConfigError(ValueError):
    """A configuration key or value that cannot be used."""


# --------------------------------------------------------------------------- model


@dataclass
class EncoderConfig:
    layers: int = 6
    """Number of encoder layers."""
    self_attention: str = "dot"
    """Registry name of the encoder self-attention (see ``ranmt.attention``; "none" removes
    the sublayer, the -SA ablation)."""
    positions: PositionsOverride = ""
    """Position embedding of the encoder: sinusoidal | learned | none; empty = model.positions."""


@dataclass
class DecoderConfig:
    layers: int = 6
    """Number of decoder layers."""
    self_attention: str = "dot"
    """Registry name of the decoder self-attention."""
    cross_attention: str = "dot"
    """Registry name of the encoder-decoder (cross) attention ("none" removes it)."""
    cross_attention_layers: CrossAttentionLayers = "all"
    """Decoder layers with cross-attention: all | last (SH-X)."""
    cross_attention_heads: int = 0
    """Heads of the cross-attention (0 = model.heads; SH-X uses 1)."""
    positions: PositionsOverride = ""
    """Position embedding of the decoder: sinusoidal | learned | none; empty = model.positions."""


def _variant_defaults() -> dict[str, Any]:
    """Every registered attention variant's options (``model.<section>``), at defaults. The
    first call imports the built-in variants (and torch)."""
    import ranmt.attention  # noqa: F401  (registers the built-in variants)
    from ranmt.attention.registry import default_options

    return default_options()


@dataclass
class ModelConfig:
    preset: str = "base"
    """Size preset applied before other values: tiny (tests) | small | base | big | student
    (6 encoder / 2 decoder layers, d 256, FFN 1536: the deployed distilled student)."""
    arch: str = "transf"
    """Attention architecture preset (sets encoder/decoder attention names): transf, ..."""
    d_model: int = 512
    """Model (embedding) dimension d."""
    heads: int = 8
    """Attention heads H; d_model must be divisible by it."""
    ffn_dim: int = 2048
    """Inner size of the position-wise feed-forward network."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    variant_options: dict[str, Any] = field(default_factory=_variant_defaults)
    """The options of every registered attention variant, one section each, read and written
    as ``model.<section>.<field>`` (``model.ran.init``, ``cfg.model.ran.init``): the sections
    are whatever the variants registered (``ranmt.attention.registry``), not fields here."""
    dropout: float = 0.1
    """Residual and embedding dropout."""
    attention_dropout: float = 0.0
    """Dropout on dot-product / hard-coded attention weights (RAN and Syn-R have their own)."""
    cross_attention_dropout: float = -1.0
    """Dropout on the cross-attention weights; negative = model.attention_dropout. RAN-ALL
    keeps 0.0 on its dot-product cross-attention, so the control TransF+AD sets
    attention_dropout 0.2 and cross_attention_dropout 0.0."""
    activation_dropout: float = 0.0
    """Dropout after the feed-forward activation."""
    norm: Norm = "pre"
    """Layer-norm placement: pre | post."""
    positions: Positions = "sinusoidal"
    """Default position embedding: sinusoidal | learned | none."""
    max_positions: int = 256
    """N: the longest sequence (in subwords, with EOS) the model handles."""
    share_embeddings: bool = True
    """Share source and target embeddings (needs a joint vocabulary; ignored otherwise)."""
    tie_output: bool = True
    """Tie the decoder output projection to the target embedding."""
    ffn: bool = True
    """Feed-forward sublayers (false = the -FF ablation of paper 004)."""
    activation: Activation = "relu"
    """Feed-forward activation: relu | gelu."""
    src_vocab_size: int = 0
    """Source vocabulary size (filled in from the prepared data at training time)."""
    tgt_vocab_size: int = 0
    """Target vocabulary size (filled in from the prepared data at training time)."""
    joint_vocab: bool = False
    """Whether source and target share one vocabulary (filled in from the data)."""

    def __getattr__(self, name: str) -> Any:
        """``cfg.ran`` etc.: a variant's options section (only names no field has)."""
        options = self.__dict__.get("variant_options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"ModelConfig has no field or variant section '{name}'")


# --------------------------------------------------------------------------- data / train / decode


@dataclass
class DataConfig:
    dir: str = ""
    """Prepared-data directory (written by ``ranmt prepare``)."""
    max_tokens: int = 4096
    """Tokens per batch, counted as sentences x longest side (padding included)."""
    max_sentences: int = 0
    """Upper bound on sentences per batch (0 = none)."""
    bucket_noise: float = 0.5
    """Random noise added to lengths before sorting, so batches differ between epochs."""
    pool_batches: int = 8
    """Sentences sorted by target length are cut into pools of this many batches' tokens,
    each pool sorted again by source length before it is cut into batches (Marian's
    maxi-batches): batches close in length on both sides, less padding (the log's ``fill``).
    0 = one sort by target length (the plan before 2026-11-28). Not with shape_buckets."""
    shape_buckets: tuple[int, ...] = ()
    """Training batches padded to a few static shapes: a batch's length (both sides) to the
    smallest of these lengths that holds it, its sentences to max_tokens // that length
    (e.g. [16,24,32,48,64,96,128]; empty = off). One compiled graph per shape for
    train.compile (compiled with dynamic=False then); the padding is in the log."""
    auto_shape_buckets: int = 0
    """Instead of data.shape_buckets: this many (source length, target length) shapes chosen
    from the training corpus's lengths (greedily, fewest padding slots; each side padded to
    its own length), e.g. 16; 0 = off. The shapes chosen are in the log."""


@dataclass
class TrainConfig:
    seed: int = 1
    """Seed for parameters, dropout and batch order."""
    lr: float = 7e-4
    """Peak learning rate, reached at the end of warm-up."""
    warmup_steps: int = 4000
    """Linear warm-up steps of the inverse-square-root schedule."""
    warmup_init_lr: float = 1e-7
    """Learning rate at step 0."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    """Clip the gradient norm to this value (0 = no clipping)."""
    accumulation: int = 1
    """Batches accumulated into one optimizer step."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = no limit)."""
    max_epochs: int = 0
    """Stop after this many epochs (0 = no limit)."""
    max_time: str = "0"
    """Stop after this wall time: seconds, or 30m / 2h / 90s (0 = no limit)."""
    validate_every: int = 1000
    """Validate (loss and BLEU) every this many steps, and at the end."""
    validate_bleu: bool = True
    """Decode the validation set (greedy) at each validation and score it with
    ``valid_metric``; the best checkpoint and early stopping use that score (false: the
    validation loss)."""
    valid_metric: ValidMetric = "bleu"
    """bleu | chrf | rouge1 | rouge2 | rougeL: the score of the validation decode (rougeL
    for summarization, scored as the test sets are). A resumed run keeps the metric it
    started with."""
    valid_max_sentences: int = 0
    """Score at most this many validation sentences (0 = all)."""
    log_every: int = 100
    """Log a line (loss, lr, tokens/s) every this many steps."""
    keep_last: int = 2
    """Number of most recent checkpoints kept besides the best."""
    patience: int = 0
    """Early stopping: validations without improvement before stopping (0 = off)."""
    precision: Precision = "auto"
    """fp32 | bf16 | bf16-weights | fp16 | auto. bf16: autocast (weights fp32, cast where
    used, every step); bf16-weights: the parameters are a bf16 compute copy and the
    optimizer updates fp32 master weights (two casts a step; ranmt.training.master).
    auto: bf16 on a CPU with native bf16 -- AVX512-BF16 or AMX --,
    bf16 autocast on a CUDA GPU with bf16, where it measured faster, fp32 with TF32 products
    on other GPUs, else fp32;
    ranmt.runtime.precision)."""
    dropout_masks: DropoutMasks = "torch"
    """torch (PyTorch's dropout) | fast: CPU training draws dropout masks from bulk random
    bits, ~4.7x cheaper per mask (ranmt.runtime.dropout; p rounded to a multiple of 2^-16). Runs
    are reproducible either way but not bit-identical to each other."""
    device: str = "auto"
    """cpu | cuda | cuda:N | auto."""
    max_nonfinite: int = 10
    """Stop after this many non-finite losses in a row (each one skips its update)."""
    host_reads: HostReads = "auto"
    """When the host reads a step's loss: step (every step: exact per-step checks and
    timing) | log (every log_every steps and before validations/checkpoints, so that a GPU
    is never left waiting for the host; non-finite updates skipped on the device by fused
    Adam, a skipped step still counts as a step; not with fp16) | auto (log on CUDA, step
    elsewhere). ranmt.training.deferred."""
    threads: int = 0
    """CPU threads for torch (0 = leave torch's default)."""
    compile: bool = False
    """Run training steps through torch.compile (same losses as eager, faster on GPUs)."""
    compile_mode: CompileMode = "default"
    """torch.compile mode of train.compile: default | reduce-overhead (CUDA graphs over the
    compiled step: static shapes, so use data.shape_buckets) | max-autotune."""
    tensorboard: bool = True
    """Write TensorBoard scalars to RUN/tensorboard."""
    progress: bool = True
    """Show a progress bar (on a terminal: with stderr redirected, only the log lines)."""


DecodeGroup = Literal["search", "output", "sampling"]


def decode_option(default: Any, help: str, *, ge: float | None = None,
                  gt: float | None = None, le: float | None = None,
                  lt: float | None = None, group: DecodeGroup = "search",
                  served: bool = False, server_default: Literal["declared", "checkpoint"]
                  = "declared", server_le: float | str | None = None) -> Any:
    """A :class:`DecodeConfig` field: its default, its bounds and its help, written once and
    read by the config's validation, the command line's flags (``ranmt translate``,
    ``ranmt evaluate``), the Python API (``Translator.load``/``translate`` keywords, through
    :func:`decode_with`) and, when ``served``, the server's request schema
    (``/openapi.json``): a new decoding option is declared here and nowhere else.

    ``group``: search (a flag of every decoding command), output (``ranmt translate`` only:
    what is returned) or sampling (``ranmt translate``'s sampling group; the server passes
    them only with ``sampling``). ``served``: a field of ``POST /translate``; its default
    there is the declared one, or None (= the checkpoint's ``decode.NAME``) with
    ``server_default="checkpoint"``; ``server_le``: the server's cap where the declaration
    has no upper bound (a number, or the name of a server limit, e.g. ``max_beam``)."""
    bounds = {key: value for key, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt))
              if value is not None}
    return field(default=default, metadata={
        "help": help, "bounds": bounds, "group": group, "served": served,
        "server_default": server_default, "server_le": server_le})


@dataclass
class DecodeConfig:
    """Decoding settings (``decode.*``): a checkpoint's are the defaults of ``ranmt
    translate``, the Python API and the server, each of which may override them."""

    beam: int = decode_option(4, "beam size (1 = greedy)", ge=1, served=True,
                              server_default="checkpoint", server_le="max_beam")
    lenpen: float = decode_option(0.6, "length penalty exponent alpha")
    lenpen_style: LengthPenaltyStyle = decode_option(
        "gnmt", "length penalty: gnmt ((5+|Y|)/6)^alpha | fairseq |Y|^alpha")
    max_len_a: float = decode_option(1.2, "output length limit a*|src|+b: a", ge=0)
    max_len_b: int = decode_option(10, "output length limit a*|src|+b: b", ge=0)
    batch_size: int = decode_option(64, "sentences per decoding batch", ge=1)
    nbest: int = decode_option(1, "hypotheses returned per input (samples with sampling); at "
                                  "most the beam size", ge=1, group="output", served=True,
                               server_default="checkpoint", server_le="max_beam")
    cuda_graphs: bool = decode_option(
        False, "search on a GPU with each search step recorded once as a CUDA graph and "
               "replayed (the sync-free search at fixed addresses; same outputs); on a CPU "
               "the same step runs eagerly, slower than the default search "
               "(ranmt.inference.graphs)")
    compile_step: bool = decode_option(
        False, "search with the encoder and the sync-free search's whole step (decoder, "
               "processors, selection) compiled by torch.compile (inductor, fullgraph, "
               "static shapes): one compilation per batch shape bucket (source length to "
               "multiples of 8, the attended span to 16, a greedy search's rows to a "
               "quarter as sentences end, a shortlist's vocabulary to 2^k or 1.5 * 2^k) "
               "and process, seconds each on a CPU (a minute or more in all), then fewer "
               "operators a step: for long-lived processes (int8 student, greedy, CPU: "
               "batch 1 2.3x, batch 32 1.2x eager); int8 layers traced as torch._int_mm "
               "with per-row scales; not with sampling or cuda_graphs "
               "(ranmt.inference.graphs.CompiledStep)")
    truncate_long: bool = decode_option(
        False, "truncate inputs longer than model.max_positions (with a warning) instead of "
               "failing")
    sampling: Sampling = decode_option(
        "none", "none (search) | topk | topp | eps: draw nbest samples per input instead "
                "(ranmt.inference.sampling)", group="sampling", served=True)
    topk: int = decode_option(0, "sampling=topk: the k most probable tokens are kept (0 = all: "
                                 "plain sampling)", ge=0, group="sampling", served=True,
                              server_le=1_000_000)
    topp: float = decode_option(0.9, "sampling=topp: the smallest set of tokens holding this "
                                     "much probability is kept", gt=0, le=1, group="sampling",
                                served=True)
    epsilon: float = decode_option(0.02, "sampling=eps: tokens of at least this probability "
                                         "are kept", ge=0, lt=1, group="sampling", served=True)
    temperature: float = decode_option(1.0, "sampling temperature (log-probs are divided by "
                                            "it before the cut)", gt=0, group="sampling",
                                       served=True, server_le=100)
    seed: int = decode_option(0, "seed of the sampling generator (same inputs, settings and "
                                 "seed: same samples)", ge=0, group="sampling", served=True,
                              server_le=2**63 - 1)
    shortlist: bool = decode_option(
        False, "restrict the output layer of each batch to its source words' candidates in "
               "the checkpoint's lexical shortlist (shortlist.safetensors beside it, written "
               "by ranmt shortlist; ranmt.inference.shortlist)", served=True,
        server_default="checkpoint")


def declare_decode_option(name: str, kind: Any, declaration: dataclasses.Field) -> None:
    """Add field ``name`` of type ``kind`` (a class or a ``Literal``; not a string) to
    :class:`DecodeConfig`, declared by ``declaration`` (:func:`decode_option`): how a step
    processor (``ranmt.inference.processors``) declares its option in its own file. The
    class is re-made in place, so every module holding it sees the field; configs made
    before read its default."""
    if name in DecodeConfig.__dataclass_fields__ or not name.isidentifier():
        raise ValueError(f"decode.{name} is already a decoding option (or not a name)")
    if declaration.default is dataclasses.MISSING:
        raise ValueError(f"decode.{name} needs a default (its value where nothing sets it)")
    _redeclare_decode_config({**_decode_declarations(), name: (kind, declaration)})


def withdraw_decode_option(name: str) -> None:
    """Remove a field added by :func:`declare_decode_option`."""
    declarations = _decode_declarations()
    if name not in declarations or name in _BUILT_IN_DECODE_FIELDS:
        raise ValueError(f"decode.{name} was not declared by declare_decode_option")
    del declarations[name]
    delattr(DecodeConfig, name)
    _redeclare_decode_config(declarations)


def _decode_declarations() -> dict[str, tuple[Any, dataclasses.Field]]:
    """DecodeConfig's fields now: name -> (type, declaration), in order."""
    hints = typing.get_type_hints(DecodeConfig)
    return {spec.name: (hints[spec.name], spec) for spec in dataclasses.fields(DecodeConfig)}


def _redeclare_decode_config(declarations: dict[str, tuple[Any, dataclasses.Field]]) -> None:
    """Re-run ``@dataclass`` over DecodeConfig with these fields (the class keeps its
    identity: the generated methods are dropped first, the declarations put back as class
    attributes, which the decorator reads)."""
    for generated in ("__init__", "__repr__", "__eq__", "__match_args__",
                      "__dataclass_fields__", "__dataclass_params__"):
        if generated in DecodeConfig.__dict__:
            delattr(DecodeConfig, generated)
    DecodeConfig.__annotations__ = {name: kind for name, (kind, _) in declarations.items()}
    for name, (_, declaration) in declarations.items():
        setattr(DecodeConfig, name, declaration)
    dataclass(DecodeConfig)


def decode_fields(group: str | None = None, served: bool | None = None
                  ) -> list[dataclasses.Field]:
    """:class:`DecodeConfig`'s fields in declaration order (read at each call: what is
    declared now), optionally of one ``group`` and/or only those (not) ``served``."""
    return [f for f in dataclasses.fields(DecodeConfig)
            if (group is None or f.metadata["group"] == group)
            and (served is None or f.metadata["served"] == served)]


_BUILT_IN_DECODE_FIELDS = frozenset(f.name for f in dataclasses.fields(DecodeConfig))
"""The fields declared in this file (:func:`withdraw_decode_option` keeps them)."""


def decode_field(name: str) -> dataclasses.Field:
    """The declaration of :class:`DecodeConfig` field ``name`` (help, bounds, default)."""
    return next(f for f in decode_fields() if f.name == name)


# bound kind -> (holds(value, bound), sign in messages)
_BOUND_TESTS = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
                "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}


def check_decode_bounds(values: dict[str, Any], label=lambda name: f"decode.{name}") -> None:
    """ConfigError for the first of ``values`` (DecodeConfig field -> value; None skipped)
    outside its declared bounds; ``label`` names a field in the message (the command line
    passes its flag)."""
    for name, value in values.items():
        if value is None:
            continue
        for kind, bound in decode_field(name).metadata["bounds"].items():
            holds, sign = _BOUND_TESTS[kind]
            if not holds(value, bound):
                raise ConfigError(f"{label(name)} must be {sign} {bound:g}, not {value}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


# --------------------------------------------------------------------------- presets

def _preset_tiny(m: ModelConfig) -> None:
    m.d_model, m.heads, m.ffn_dim = 64, 4, 128
    m.encoder.layers = m.decoder.layers = 2
    m.max_positions = 64


def _preset_small(m: ModelConfig) -> None:
    m.d_model, m.heads, m.ffn_dim = 256, 4, 1024
    m.encoder.layers = m.decoder.layers = 3


def _preset_base(m: ModelConfig) -> None:
    m.d_model, m.heads, m.ffn_dim = 512, 8, 2048
    m.encoder.layers = m.decoder.layers = 6


def _preset_big(m: ModelConfig) -> None:
    """Vaswani et al.'s Transformer big (MLPerf Training's Transformer)."""
    m.d_model, m.heads, m.ffn_dim = 1024, 16, 4096
    m.encoder.layers = m.decoder.layers = 6


def _preset_student(m: ModelConfig) -> None:
    """The deployed CPU student (Bergamot's "tiny": 6 encoder and 2 decoder layers, d 256,
    FFN 1536, 8 heads; a shared vocabulary when the data has one, as by default)."""
    m.d_model, m.heads, m.ffn_dim = 256, 8, 1536
    m.encoder.layers, m.decoder.layers = 6, 2


MODEL_PRESETS = {"tiny": _preset_tiny, "small": _preset_small, "base": _preset_base,
                 "big": _preset_big, "student": _preset_student}


def arch_presets() -> dict[str, Any]:
    """``model.arch`` name -> :class:`ranmt.attention.registry.Arch`: the presets the
    registered variants declared (transf, ran-e, ran-d, ran-all, hc-sa, hc-all, sh-x, syn-r
    and any registered since)."""
    import ranmt.attention  # noqa: F401  (registers the built-in variants)
    from ranmt.attention.registry import ARCHS

    return ARCHS


# --------------------------------------------------------------------------- (de)serialisation

def _children(cfg: Any) -> list[tuple[str, Any]]:
    """(name, value) of every entry of a config node: its dataclass fields, with
    ``ModelConfig.variant_options`` expanded in place into the variants' sections."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(cfg, ModelConfig) and f.name == "variant_options":
            out.extend(value.items())
        else:
            out.append((f.name, value))
    return out


def to_dict(cfg: Any) -> dict:
    """Nested plain dict (tuples become lists) suitable for JSON/YAML."""
    out = {}
    for name, value in _children(cfg):
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def from_dict(data: dict) -> Config:
    """Rebuild a :class:`Config` from :func:`to_dict` output (no presets applied)."""
    cfg = Config()
    for key, value in _flatten(data).items():
        set_value(cfg, key, value)
    return cfg


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def all_keys(cfg: Any = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree."""
    cfg = Config() if cfg is None else cfg
    keys = []
    for name, value in _children(cfg):
        if dataclasses.is_dataclass(value):
            keys.extend(all_keys(value, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _field_type(obj: Any, name: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    return hints[name]


def _convert(value: Any, typ: Any, key: str) -> Any:
    """Convert ``value`` (a YAML scalar or a command-line string) to ``typ``."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        return _choice(value, typing.get_args(typ), key)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.strip())
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if origin is tuple:
            if isinstance(value, str):
                value = yaml.safe_load(value if value.strip().startswith("[") else f"[{value}]")
            args = typing.get_args(typ)
            if len(args) == 2 and args[1] is Ellipsis:  # tuple[T, ...]: any length
                if value is None:
                    return ()
                if not isinstance(value, (list, tuple)):
                    raise ValueError
                return tuple(_convert(v, args[0], key) for v in value)
            if not isinstance(value, (list, tuple)) or len(value) != len(args):
                raise ValueError
            return tuple(_convert(v, a, key) for v, a in zip(value, args))
        if origin in (typing.Union, types.UnionType):
            raise ValueError  # no union fields for now
    except (TypeError, ValueError):
        pass
    else:
        return value
    type_name = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"config key '{key}': cannot use {value!r} as {type_name}")


def _choice(value: Any, allowed: tuple, key: str) -> Any:
    """``value`` as one of a Literal field's ``allowed`` choices (converted to their type:
    "2" -> 2 for integer choices), or a ConfigError that lists them and suggests the
    closest."""
    kind = type(allowed[0])
    try:
        converted = kind(value.strip()) if isinstance(value, str) else value
    except ValueError:
        converted = value
    if isinstance(converted, bool) or converted not in allowed:
        shown = ", ".join(repr(a) if a == "" else str(a) for a in allowed)
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1,
                                          cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{key} '{value}' unknown; choose from {shown}{hint}")
    return converted


def check_choices(cfg: Any, prefix: str = "") -> None:
    """Every Literal-typed field of the tree holds one of its choices (values set directly
    on the dataclasses bypass :func:`set_value`)."""
    hints = typing.get_type_hints(type(cfg))
    for name, value in _children(cfg):
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{name}.")
        elif typing.get_origin(hints[name]) is Literal:
            _choice(value, typing.get_args(hints[name]), f"{prefix}{name}")


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set dotted ``key`` to ``value`` converted to the field's type."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        names = {name for name, _ in _children(obj)}
        if part not in names:
            close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{hint}")
        if i == len(parts) - 1:
            current = getattr(obj, part)
            if dataclasses.is_dataclass(current):
                raise ConfigError(f"config key '{key}' is a section; set one of its fields")
            setattr(obj, part, _convert(value, _field_type(obj, part), key))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config key '{key}': '{part}' is not a section")


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": "1", "c": "x"}``."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def validate(cfg: Config) -> None:
    """Check values that each field's type alone does not constrain."""
    m = cfg.model
    if m.preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset '{m.preset}' unknown; choose from {sorted(MODEL_PRESETS)}")
    apply_arch(ModelConfig(), m.arch)  # raises on an unknown name
    check_choices(cfg)
    _validate_variants(m)
    cross_heads = m.decoder.cross_attention_heads or m.heads
    if cross_heads < 0 or m.d_model % cross_heads:
        raise ConfigError("model.decoder.cross_attention_heads must divide model.d_model")
    if m.d_model <= 0 or m.heads <= 0 or m.d_model % m.heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be a positive multiple of model.heads")
    if m.max_positions < 2:
        raise ConfigError("model.max_positions must be at least 2")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0.0 <= getattr(m, key) < 1.0:
            raise ConfigError(f"model.{key} must be in [0, 1)")
    if m.cross_attention_dropout >= 1.0:
        raise ConfigError("model.cross_attention_dropout must be < 1 (negative = "
                          "model.attention_dropout)")
    if m.encoder.layers < 1 or m.decoder.layers < 1:
        raise ConfigError("model.encoder.layers and model.decoder.layers must be >= 1")
    validate_decode(cfg.decode)
    t = cfg.train
    if t.accumulation < 1:
        raise ConfigError("train.accumulation must be >= 1")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError("train.label_smoothing must be in [0, 1)")
    for key in ("max_steps", "max_epochs", "warmup_steps", "keep_last", "patience"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be non-negative")
    if t.validate_every < 1:  # 0 once crashed the trainer (modulo by zero) at its first step
        raise ConfigError("train.validate_every must be >= 1 (a run also validates at its end)")
    parse_duration(t.max_time)
    if cfg.data.max_tokens < 1:
        raise ConfigError("data.max_tokens must be >= 1")
    buckets = cfg.data.shape_buckets
    if any(length < 2 for length in buckets) or list(buckets) != sorted(set(buckets)):
        raise ConfigError("data.shape_buckets must be increasing lengths >= 2 (tokens per "
                          f"side, EOS included), not {list(buckets)}")
    if cfg.data.auto_shape_buckets < 0:
        raise ConfigError("data.auto_shape_buckets must be >= 0 (0 = off)")
    if buckets and cfg.data.auto_shape_buckets:
        raise ConfigError("data.shape_buckets and data.auto_shape_buckets exclude each other: "
                          "give the lengths or let the trainer choose them, not both")


def _validate_variants(m: ModelConfig) -> None:
    """Each role names a registered variant that may fill it, and each variant section
    passes its own ``validate()`` (its errors name the field; the key is added here)."""
    from ranmt.attention.registry import check_name

    roles = {"encoder_self": ("encoder.self_attention", m.encoder.self_attention),
             "decoder_self": ("decoder.self_attention", m.decoder.self_attention),
             "cross": ("decoder.cross_attention", m.decoder.cross_attention)}
    for role, (key, name) in roles.items():
        if name != "none":
            try:
                check_name(name, role)
            except ValueError as err:
                raise ConfigError(f"model.{key}: {err}") from None
    for section, options in m.variant_options.items():
        check = getattr(options, "validate", None)
        try:
            if check is not None:
                check()
        except ValueError as err:
            raise ConfigError(f"model.{section}.{err}") from None


def parse_duration(text: str | int | float) -> float:
    """``"30m"`` -> 1800.0, ``"2h"`` -> 7200.0, ``"90"``/``"90s"`` -> 90.0."""
    raw = str(text).strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        unit = scale.get(raw[-1:])
        seconds = float(raw[:-1]) * unit if unit else float(raw)
    except ValueError:
        raise ConfigError(f"cannot read duration '{text}' (use e.g. 1800, 30m, 2h)") from None
    if seconds < 0:
        raise ConfigError(f"duration '{text}' is negative")
    return seconds


def load_config(path: str | Path | None = None,
                overrides: list[str] | dict | None = None) -> Config:
    """Build a config from defaults, presets, a YAML file and overrides (see module doc)."""
    file_values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        with open(path, encoding="utf-8") as handle:
            try:
                loaded = yaml.safe_load(handle) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        file_values = _flatten(loaded)
    if isinstance(overrides, dict):
        cli_values = dict(overrides)
    else:
        cli_values = parse_overrides(list(overrides or []))

    cfg = Config()
    for key in ("model.preset", "model.arch"):
        value = cli_values.get(key, file_values.get(key))
        if value is not None:
            set_value(cfg, key, value)
    validate_presets(cfg)
    MODEL_PRESETS[cfg.model.preset](cfg.model)
    apply_arch(cfg.model, cfg.model.arch)
    for source in (file_values, cli_values):
        for key, value in source.items():
            if key not in ("model.preset", "model.arch"):
                set_value(cfg, key, value)
    validate(cfg)
    return cfg


def apply_arch(m: ModelConfig, name: str) -> None:
    """Apply architecture ``name``: a preset, optionally followed by ``-sa`` (no
    self-attention sublayers) and/or ``-ff`` (no feed-forward sublayers), e.g. ``transf-sa``,
    ``sh-x-sa``, ``hc-sa-ff`` (paper 004 Table 3, Fig. 3)."""
    presets = arch_presets()
    base, ablations = name, []
    while base not in presets and base.endswith(("-sa", "-ff")):
        ablations.append(base[-2:])
        base = base[:-3]
    if base not in presets:
        raise ConfigError(f"model.arch '{name}' unknown; choose from {sorted(presets)}, "
                          "optionally with -sa / -ff suffixes")
    arch = presets[base]
    m.encoder.self_attention = arch.encoder_self
    m.decoder.self_attention = arch.decoder_self
    m.decoder.cross_attention = arch.cross
    m.decoder.cross_attention_layers = arch.cross_layers
    m.decoder.cross_attention_heads = arch.cross_heads
    if "sa" in ablations:
        m.encoder.self_attention = m.decoder.self_attention = "none"
    if "ff" in ablations:
        m.ffn = False


def validate_presets(cfg: Config) -> None:
    if cfg.model.preset not in MODEL_PRESETS:
        raise ConfigError(
            f"model.preset '{cfg.model.preset}' unknown; choose from {sorted(MODEL_PRESETS)}")
    apply_arch(ModelConfig(), cfg.model.arch)  # raises on an unknown name


def save_yaml(cfg: Config, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(to_dict(cfg), handle, sort_keys=False)


def check_sampling(topk: int, topp: float, epsilon: float, temperature: float,
                   prefix: str = "") -> None:
    """The ranges of the sampling settings (``ranmt.inference.sampling.Sampler`` and
    decode.*), as :class:`DecodeConfig` declares them."""
    check_decode_bounds({"topk": topk, "topp": topp, "epsilon": epsilon,
                         "temperature": temperature}, lambda name: f"{prefix}{name}")


def decode_conflict(d: DecodeConfig, label=lambda name: f"decode.{name}") -> str | None:
    """The first rule across decoding fields that ``d`` breaks, as a message naming the
    fields by ``label`` (the server passes its request fields' names), or None. The one
    place these rules live: the config's validation (so the command line and the Python
    API) and the server's requests (``ranmt.serving.app``) read them here."""
    if d.sampling == "none" and d.nbest > d.beam:
        return (f"{label('nbest')} must be between 1 and the beam size ({label('beam')} = "
                f"{d.beam}), not {d.nbest}")
    if d.shortlist and d.cuda_graphs:
        return (f"{label('shortlist')} does not go with {label('cuda_graphs')}: a recorded "
                "step's output layer is fixed, a shortlist changes it per batch")
    if d.compile_step and d.cuda_graphs:
        return f"{label('compile_step')} and {label('cuda_graphs')}: choose one"
    if d.compile_step and d.sampling != "none":
        return f"{label('sampling')} is not compiled: not with {label('compile_step')}"
    return None


def validate_decode(d: DecodeConfig) -> None:
    """Check the decoding settings: each field within its declared bounds, and the rules
    across fields (:func:`decode_conflict`: nbest at most the beam when searching, ...)."""
    check_choices(d, "decode.")
    check_decode_bounds({f.name: getattr(d, f.name) for f in dataclasses.fields(d)})
    conflict = decode_conflict(d)
    if conflict is not None:
        raise ConfigError(conflict)


def decode_with(decode: DecodeConfig, **overrides) -> DecodeConfig:
    """A copy of ``decode`` with ``overrides`` (None values skipped) converted to the fields'
    types and validated: the one way decoding options are applied (Translator, the grids,
    validation during training)."""
    # the fields declared now (DecodeConfig's), the given ones' values kept
    declared = {f.name for f in dataclasses.fields(DecodeConfig)}
    out = DecodeConfig(**{f.name: getattr(decode, f.name) for f in dataclasses.fields(decode)
                          if f.name in declared})
    hints = typing.get_type_hints(DecodeConfig)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in hints:
            close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown decoding option '{key}'{hint}")
        setattr(out, key, _convert(value, hints[key], f"decode.{key}"))
    validate_decode(out)
    return out
