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
from typing import Annotated, Any

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
    score: float | None = Field(description="length-normalised log-probability (null where "
                                            "undefined)")


class Translation(Hypothesis):
    nbest: list[Hypothesis] | None = Field(None, description="with nbest > 1: the n best, "
                                                             "best first")
    attention: dict[str, Any] | None = Field(None, description="with attention: true: "
                                                               "tokens and per-layer weights")


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation] = Field(description="one entry per input line, in order")


class ErrorResponse(BaseModel):
    error: str = Field(description="what was wrong, naming the field")


class _TranslateBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _nbest_within_beam(self):
        if self.nbest > self.beam:
            raise ValueError("nbest_above_beam")
        return self


def request_model(max_lines: int, max_chars: int, max_beam: int,
                  max_timeout_s: float) -> type[BaseModel]:
    """The ``POST /translate`` body for these limits (a pydantic model)."""
    line = Annotated[StrictStr, Field(max_length=max_chars)]
    return create_model(
        "TranslateRequest", __base__=_TranslateBase,
        text=(list[line], Field(min_length=1, max_length=max_lines,
                                description="lines to translate")),
        model=(StrictStr | None, Field(None, description="a name from GET /models (default: "
                                                         "the first loaded)")),
        beam=(StrictInt, Field(4, ge=1, le=max_beam, description="beam size")),
        nbest=(StrictInt, Field(1, ge=1, le=max_beam, description="hypotheses per line, at "
                                                                  "most the beam size")),
        attention=(StrictBool, Field(False, description="return attention weights")),
        timeout_s=(StrictFloat | None, Field(
            None, gt=0, le=max_timeout_s, description="give up (504) if the batch has not "
                                                      "started by then; default and most: "
                                                      "the server's --request-timeout")),
    )


def parse_translate(body: bytes, model: type[BaseModel]):
    """The validated body, or :class:`RequestError` with the API's message."""
    try:
        data = json.loads(body)
    except RecursionError:  # e.g. [[[[...]]]] nested deeper than Python's parser goes
        raise RequestError(400, "invalid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as err:  # ValueError: also over-long integers
        raise RequestError(400, f"invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object with a 'text' list")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _refusal(err.errors(include_url=False), data, model) from None


# The order in which problems are reported when a body has several (the first wins).
_FIELD_ORDER = ("text", "model", "beam", "nbest", "attention", "timeout_s")


def _refusal(errors: list[dict], data: dict, model: type[BaseModel]) -> RequestError:
    """One :class:`RequestError` for pydantic's ``errors`` of body ``data``."""
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if extra:
        allowed = sorted(model.model_fields)
        return RequestError(400, f"unknown field(s) {extra}; allowed: {allowed}")
    errors = sorted(errors, key=lambda e: _FIELD_ORDER.index(e["loc"][0])
                    if e["loc"] and e["loc"][0] in _FIELD_ORDER else len(_FIELD_ORDER))
    error = errors[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    kind, context = error["type"], error.get("ctx", {})
    if kind == "value_error" and "nbest_above_beam" in error["msg"]:
        return RequestError(400, f"'nbest' must be between 1 and the beam size, not "
                                 f"{data.get('nbest')}")
    if field == "text":
        return _text_refusal(kind, error, data, context)
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
    return RequestError(400, f"invalid request: {error['msg']}")


def _text_refusal(kind: str, error: dict, data: dict, context: dict) -> RequestError:
    if kind == "missing":
        return RequestError(400, "missing field 'text' (a list of lines to translate)")
    if kind == "too_short":
        return RequestError(400, "'text' is empty: give at least one line")
    if kind == "too_long" and len(error["loc"]) == 1:
        return RequestError(413, f"'text' has {len(data['text'])} lines; at most "
                                 f"{context['max_length']} per request")
    if kind == "string_too_long":
        number = int(error["loc"][1]) + 1
        return RequestError(413, f"line {number} has {len(data['text'][number - 1])} "
                                 f"characters; at most {context['max_length']}")
    return RequestError(400, "'text' must be a list of strings")


def _bound(model: type[BaseModel], field: str, name: str) -> float:
    for item in model.model_fields[field].metadata:
        if hasattr(item, name):
            return getattr(item, name)
    raise KeyError(f"{field} has no {name} bound")
