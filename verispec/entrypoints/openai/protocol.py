"""The OpenAI wire format: request bodies in, response and error JSON out.

Requests are validated in two stages: pydantic checks the shape (types, known fields), then the
values become a :class:`~verispec.config.GenerationConfig`, which checks ranges exactly as the CLI
and the Python API do. Either failure is an :class:`APIError` with status 400 and the offending
``param``. Fields the OpenAI API defines but verispec does not implement (``logprobs``, penalties,
``n`` other than 1) are refused with a message saying so, never silently ignored.

verispec extensions in the body: ``top_k`` (as in vLLM), ``ignore_eos``, and
``"speculative": {"enabled": bool, "num_speculative_tokens": int}``. Each response carries the
request's acceptance statistics in an extra top-level field ``"speculative"``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from verispec.config import ConfigError, GenerationConfig, SamplingConfig


class APIError(Exception):
    """An error answered with OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        500: "internal_server_error",
        503: "service_unavailable_error",
    }

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class SpeculativeOptions(BaseModel):
    """Per-request control of speculation (verispec extension)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    num_speculative_tokens: int | None = None
    """Draft length for this request; None = the server's --num-speculative-tokens."""


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")  # clients send fields we ignore harmlessly (user, ...)

    model: str | None = None
    """The served model's name; None (left out) means the one model this server serves, as vLLM allows."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if isinstance(v, str):
            return [v]
        return v


class ChatMessage(BaseModel):
    """One message; ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text, parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    """Body of POST /v1/completions."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body against ``model``; shape errors become a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"invalid value for '{param}': {first['msg']}", param=param) from None


@dataclass(frozen=True)
class RequestPlan:
    """A validated request: what to generate, and how the answer is sent."""

    config: GenerationConfig
    speculate: bool
    """False when the request switched speculation off."""
    stream: bool
    include_usage: bool


def plan(req: _Common, prompt_len: int, max_model_len: int, default_k: int) -> RequestPlan:
    """Turn a parsed request into a validated :class:`RequestPlan`; raises :class:`APIError` (400)."""
    if req.n != 1:
        raise APIError(
            400, f"n={req.n} is not supported: verispec returns exactly one choice (n=1)", param="n"
        )
    if req.presence_penalty or req.frequency_penalty:
        raise APIError(
            400,
            "presence_penalty and frequency_penalty are not supported",
            param="presence_penalty" if req.presence_penalty else "frequency_penalty",
        )
    if getattr(req, "logprobs", None) or getattr(req, "top_logprobs", None):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if getattr(req, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of other than 1 is not supported", param="best_of")
    if getattr(req, "echo", False):
        raise APIError(400, "echo is not supported", param="echo")
    if getattr(req, "suffix", None):
        raise APIError(400, "suffix is not supported", param="suffix")
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens (at least one new token must fit).",
            param="messages",
            code="context_length_exceeded",
        )
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = tuple(req.stop or ())
    if len(stop) > 16:
        raise APIError(400, "at most 16 stop strings are supported", param="stop")
    spec = req.speculative or SpeculativeOptions()
    k = default_k if spec.num_speculative_tokens is None else spec.num_speculative_tokens
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    try:
        sampling = SamplingConfig(
            temperature=1.0 if req.temperature is None else req.temperature, top_k=top_k, top_p=req.top_p
        )
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            num_speculative_tokens=k if spec.enabled else 0,
            sampling=sampling,
            seed=req.seed,
            stop=stop,
            ignore_eos=req.ignore_eos,
        )
    except ConfigError as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc))) from None
    include_usage = bool((req.stream_options or {}).get("include_usage", False))
    return RequestPlan(
        config=config, speculate=spec.enabled and k > 0, stream=req.stream, include_usage=include_usage
    )


def _param_of(message: str) -> str | None:
    """The body field a ConfigError message is about (it starts with the field's name)."""
    name = message.split(" ", 1)[0]
    known = {"max_new_tokens": "max_tokens", "num_speculative_tokens": "speculative.num_speculative_tokens"}
    return known.get(name, name if name.isidentifier() else None)


def new_id(prefix: str) -> str:
    """A unique response id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def speculative_stats(stats: dict[str, Any], k: int) -> dict[str, Any]:
    """The acceptance statistics returned in the ``speculative`` field (names as in ``GenerationStats``)."""
    keys = (
        "target_calls",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "accepted_per_position",
        "drafted_per_position",
    )
    out = {"num_speculative_tokens": k}
    out.update({key: stats[key] for key in keys})
    return out


def created() -> int:
    """Unix time for the ``created`` field."""
    return int(time.time())
