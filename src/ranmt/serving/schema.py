"""The bodies of ``ranmt serve``'s API as pydantic models: validation and the OpenAPI schema.

:func:`request_model` builds the ``POST /translate`` body model for a server's limits (the
bounds of ``text``, ``beam`` and ``timeout_s`` are the server's), so that the schema at
``/openapi.json`` (and the page at ``/docs``) states every field with its bounds.
:func:`parse_translate` validates a body with it and turns pydantic's errors into the API's
4xx contract: one message that names the field and the problem (the messages of
docs/SERVING.md), 413 for what is too large, 400 for the rest.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
    model_validator,
)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(description="length-normalised log-probability (beam), "
                                            "summed log-probability (greedy, sampling); null "
                                            "where undefined")
    alignment: list[tuple[int, int]] | None = Field(
        None, description="with alignment: true: [source word, target word] pairs (0-based, "
                          "words split at whitespace) from the cross-attention")


class Translation(Hypothesis):
    nbest: list[Hypothesis] | None = Field(None, description="with nbest > 1: the n best, "
                                                             "best first")
    attention: dict[str, Any] | None = Field(None, description="with attention: true: "
                                                               "tokens and per-layer weights")


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation] = Field(description="one entry per input line, in order")


class PairScore(BaseModel):
    normalized: float = Field(description="total / length penalty: the beam search score")
    total: float = Field(description="log p(target | source), EOS included")
    token_logprobs: list[float] = Field(description="per target subword, then EOS")
    tokens: list[str] = Field(description="the target subwords, then </s>")


class ScoreResponse(BaseModel):
    model: str
    scores: list[PairScore | None] = Field(description="one per pair, in order; null where "
                                                       "the source or target is empty")


class ErrorResponse(BaseModel):
    error: str = Field(description="what was wrong, naming the field")


class _TranslateBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _prefix_per_line(self):
        # (nbest against the beam: the server checks the merged options,
        # ranmt.config.decode_conflict, where the checkpoint's defaults are known)
        if self.prefix is not None and len(self.prefix) != len(self.text):
            raise ValueError("prefix_lines")
        return self


class _ScoreBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _paired(self):
        if len(self.target) != len(self.source):
            raise ValueError("unpaired")
        return self


def request_model(max_lines: int, max_chars: int, max_beam: int,
                  max_timeout_s: float) -> type[BaseModel]:
    """The ``POST /translate`` body for these limits (a pydantic model). Its decoding fields
    are the :class:`ranmt.config.DecodeConfig` fields declared ``served``, each with its
    declared help, bounds and default (None = the checkpoint's where so declared)."""
    line = Annotated[StrictStr, Field(max_length=max_chars)]
    return create_model(
        "TranslateRequest", __base__=_TranslateBase,
        text=(list[line], Field(min_length=1, max_length=max_lines,
                                description="lines to translate")),
        model=(StrictStr | None, Field(None, description="a name from GET /models (default: "
                                                         "the first loaded)")),
        **served_decode_fields({"max_beam": max_beam}),
        attention=(StrictBool, Field(False, description="return attention weights")),
        timeout_s=_timeout_field(max_timeout_s),
        prefix=(list[line] | None, Field(None, max_length=max_lines, description=(
            "per line the text its translation starts with (\"\": none); as many lines as "
            "'text' (else 400: JSON Schema cannot say that two arrays are as long)"))),
        alignment=(StrictBool, Field(False, description="return word alignments")),
    )


_STRICT = {int: StrictInt, float: StrictFloat, bool: StrictBool, str: StrictStr}


def served_decode_fields(server_limits: dict[str, float]) -> dict[str, tuple]:
    """Request fields of the served :class:`ranmt.config.DecodeConfig` fields: strict JSON
    types (an enumeration without its ``none``, which is the field left out), the declared
    bounds and the server's cap (``server_le``: a number or a name in ``server_limits``)
    where the declaration has no upper bound, the declared help, and the declared default
    or None (``server_default="checkpoint"``; an enumeration: None = not used)."""
    from ranmt.config import DecodeConfig, decode_fields

    hints = get_type_hints(DecodeConfig)
    fields = {}
    for spec in decode_fields(served=True):
        meta, kind = spec.metadata, hints[spec.name]
        bounds = dict(meta["bounds"])
        cap = meta["server_le"]
        if cap is not None and "le" not in bounds and "lt" not in bounds:
            bounds["le"] = server_limits[cap] if isinstance(cap, str) else cap
        if get_origin(kind) is Literal:
            choices = tuple(c for c in get_args(kind) if c != "none")
            annotation, default = Literal[choices] | None, None
        else:
            annotation, default = _STRICT[kind], spec.default
        description = meta["help"]
        if meta["server_default"] == "checkpoint":
            annotation, default = annotation | None, None
            most = f"; at most the server's {cap}" if isinstance(cap, str) else ""
            description += (f" (default: the checkpoint's decode.{spec.name}, as `ranmt "
                            f"translate` uses it{most})")
        fields[spec.name] = (annotation, Field(default, description=description, **bounds))
    return fields


def _timeout_field(max_timeout_s: float):
    return (StrictFloat | None, Field(
        None, gt=0, le=max_timeout_s, description="seconds after arrival when the request "
                                                  "is answered 504 if it is not done (its "
                                                  "lines are dropped, decoding or not); "
                                                  "default and most: the server's "
                                                  "--request-timeout"))


def score_request_model(max_lines: int, max_chars: int, max_timeout_s: float
                        ) -> type[BaseModel]:
    """The ``POST /score`` body for these limits: ``source`` and ``target`` lines, paired."""
    line = Annotated[StrictStr, Field(max_length=max_chars)]
    return create_model(
        "ScoreRequest", __base__=_ScoreBase,
        source=(list[line], Field(min_length=1, max_length=max_lines,
                                  description="source lines")),
        target=(list[line], Field(min_length=1, max_length=max_lines, description=(
            "one target per source line, paired in order: as many lines as 'source' (else "
            "400: JSON Schema cannot say that two arrays are as long)"))),
        model=(StrictStr | None, Field(None, description="a name from GET /models")),
        timeout_s=_timeout_field(max_timeout_s))


def parse_translate(body: bytes, model: type[BaseModel]):
    """The validated body (of ``/translate`` or ``/score``, by ``model``), or
    :class:`RequestError` with the API's message."""
    try:
        data = json.loads(body)
    except RecursionError:  # e.g. [[[[...]]]] nested deeper than Python's parser goes
        raise RequestError(400, "invalid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as err:  # ValueError: also over-long integers
        raise RequestError(400, f"invalid JSON: {err}") from None
    if not isinstance(data, dict):
        wanted = ("'source' and 'target' lists" if "source" in model.model_fields
                  else "a 'text' list")
        raise RequestError(400, f"the body must be a JSON object with {wanted}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _refusal(err.errors(include_url=False), data, model) from None


def _refusal(errors: list[dict], data: dict, model: type[BaseModel]) -> RequestError:
    """One :class:`RequestError` for pydantic's ``errors`` of body ``data``."""
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if extra:
        allowed = sorted(model.model_fields)
        return RequestError(400, f"unknown field(s) {extra}; allowed: {allowed}")
    # several problems: the first field in the request model's order is reported (text,
    # model, the decoding options as DecodeConfig declares them, then the rest)
    order = list(model.model_fields)
    errors = sorted(errors, key=lambda e: order.index(e["loc"][0])
                    if e["loc"] and e["loc"][0] in order else len(order))
    error = errors[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    kind, context = error["type"], error.get("ctx", {})
    if kind == "value_error" and "prefix_lines" in error["msg"]:
        return RequestError(400, f"'prefix' has {len(data['prefix'])} lines but 'text' has "
                                 f"{len(data['text'])}: give one prefix per line")
    if kind == "value_error" and "unpaired" in error["msg"]:
        return RequestError(400, f"'source' has {len(data['source'])} lines but 'target' has "
                                 f"{len(data['target'])}: give one target per source line")
    if field in ("text", "source", "target", "prefix"):
        return _text_refusal(field, kind, error, data, context)
    if field in ("beam", "nbest"):
        if kind in ("greater_than_equal", "less_than_equal"):
            high = "the beam size" if field == "nbest" else _bound(model, "beam", "le")
            return RequestError(400, f"'{field}' must be between 1 and {high}, not "
                                     f"{data[field]}")
        return RequestError(400, f"'{field}' must be an integer")
    if field == "model":
        return RequestError(400, "'model' must be a string (a name from GET /models)")
    if field == "attention":
        return RequestError(400, "'attention' must be true or false")
    if field == "timeout_s":
        most = _bound(model, "timeout_s", "le")
        return RequestError(400, f"'timeout_s' must be a number of seconds above 0 and at "
                                 f"most {most:g}")
    if field in model.model_fields:  # the other decoding fields (DecodeConfig's served
        # ones, whatever they are): name the field and pydantic's reason
        return RequestError(400, f"'{field}': {error['msg'][0].lower()}{error['msg'][1:]}")
    return RequestError(400, f"invalid request: {error['msg']}")


def _text_refusal(field: str, kind: str, error: dict, data: dict, context: dict
                  ) -> RequestError:
    if kind == "missing":
        return RequestError(400, f"missing field '{field}' (a list of lines"
                                 + (" to translate)" if field == "text" else ")"))
    if kind == "too_short":
        return RequestError(400, f"'{field}' is empty: give at least one line")
    if kind == "too_long" and len(error["loc"]) == 1:
        return RequestError(413, f"'{field}' has {len(data[field])} lines; at most "
                                 f"{context['max_length']} per request")
    if kind == "string_too_long":
        number = int(error["loc"][1]) + 1
        where = "line" if field == "text" else f"'{field}' line"
        return RequestError(413, f"{where} {number} has {len(data[field][number - 1])} "
                                 f"characters; at most {context['max_length']}")
    return RequestError(400, f"'{field}' must be a list of strings")


def _bound(model: type[BaseModel], field: str, name: str) -> float:
    for item in model.model_fields[field].metadata:
        if hasattr(item, name):
            return getattr(item, name)
    raise KeyError(f"{field} has no {name} bound")
