# SPDX-License-Identifier: Apache-2.0
"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields), validated strictly.

Unknown fields are refused, as OpenAI refuses them ("Unrecognized request argument supplied"); types are not
coerced (``"16"`` is not a number). OpenAI fields this server does not implement are accepted at their neutral
value (``n=1``, penalties 0, no ``logit_bias``, no ``logprobs``, no tools) and refused otherwise. Two extensions,
as vLLM spells them: ``ignore_eos`` (EOS does not end the completion) and ``return_token_ids`` (each choice also
carries its ``token_ids``, and the response the ``prompt_token_ids``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvexport.serve.errors import APIError, bad_request
from kvexport.serve.limits import clip

#: characters of one stop string, at most (the text a stream holds back is as long as the longest one)
STOP_CHARS = 256
StopString = Annotated[str, Field(max_length=STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Int64 | None = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise bad_request("Invalid 'stop': stop strings must not be empty.", "stop", "invalid_value")
        return stops

    def check_supported(self) -> None:
        """Refuse OpenAI features this server does not implement (400, naming the parameter), and
        ``stream_options`` without ``stream`` (as OpenAI does)."""
        for name, value, neutral in self._features():
            if value is not None and value != neutral:
                raise bad_request(f"'{name}' = {clip(value)} is not supported by this server (only {neutral!r}).",
                                  name, "unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options", "invalid_value")

    def _features(self) -> list[tuple[str, Any, Any]]:
        return [("n", self.n, 1), ("presence_penalty", self.presence_penalty, 0),
                ("frequency_penalty", self.frequency_penalty, 0), ("logit_bias", self.logit_bias or None, None)]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _features(self):
        return super()._features() + [("echo", self.echo, False), ("logprobs", self.logprobs, None),
                                      ("best_of", self.best_of, 1), ("suffix", self.suffix, None)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": content}


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def _features(self):
        fmt = (self.response_format or {}).get("type", "text") if self.response_format is not None else None
        return super()._features() + [("logprobs", self.logprobs, False), ("top_logprobs", self.top_logprobs, None),
                                      ("response_format", fmt, "text"), ("tools", self.tools or None, None),
                                      ("tool_choice", self.tool_choice, "none"),
                                      ("parallel_tool_calls", self.parallel_tool_calls, None)]

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(cls: type[_Request], body: Any) -> _Request:
    """A JSON value -> a validated request, or the 400 OpenAI would answer."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e, cls) from None
    req.check_supported()
    return req


def from_validation_error(e: ValidationError, cls: type[BaseModel] | None = None) -> APIError:
    """The first problem pydantic found, worded as OpenAI words it. Where a union's members all failed (``stop``:
    a string or a list), a member's value error says more than the other members' type errors."""
    errors = e.errors()
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    param = ".".join(str(p) for p in _path(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    bound = {"greater_than_equal": ("below minimum", "min", ">=", "ge"),
             "less_than_equal": ("above maximum", "max", "<=", "le")}.get(kind)
    if bound is not None and isinstance(err.get("input"), (int, float)) and not isinstance(err["input"], bool):
        number = "decimal" if _is_float(cls, err["loc"]) else "integer"
        where, code, op, key = bound
        limit = err["ctx"][key]
        limit = int(limit) if number == "integer" or float(limit).is_integer() else limit
        return bad_request(f"Invalid '{param}': {number} {where} value. Expected a value {op} {limit}, but got "
                           f"{clip(err['input'])} instead.", param, f"{number}_{where.split()[0]}_{code}_value")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than", "too_long", "too_short",
                "string_too_long", "literal_error"):
        return bad_request(f"Invalid value for '{param}': {err['msg']}.", param, "invalid_value")
    return bad_request(f"Invalid type for '{param}': {err['msg']}.", param, "invalid_type")


def _is_float(cls: type[BaseModel] | None, loc) -> bool:
    """Whether the top-level field at ``loc`` is a number with decimals (OpenAI words its bounds "decimal")."""
    field = cls.model_fields.get(loc[0]) if cls is not None and loc else None
    return field is not None and "float" in str(field.annotation)


def _is_type_name(part: str) -> bool:
    """pydantic puts union members into error locations (``'list[int]'``, ``'str'``); they are no parameter."""
    return any(ch in part for ch in "[]") or part in ("str", "int", "float", "bool", "none", "function-after",
                                                      "constrained-str")


def _path(loc) -> list:
    return [p for p in loc if isinstance(p, int) or not _is_type_name(p)]


__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "StreamOptions", "parse", "from_validation_error"]
