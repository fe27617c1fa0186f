"""Request bodies of the OpenAI-compatible API, and their mapping to SamplingParams.

Models are strict: a value of the wrong JSON type is a 422 (no "5" -> 5 coercion); a value
of the right type but out of range is a 400 from `SamplingParams.validate` or the checks
here. Unknown fields are accepted and ignored (clients send vendor fields), except those
whose silent ignoring would change the result; those are refused with a 400 (`unsupported`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from stopline.request import SamplingParams
from stopline.server.errors import ApiError

MAX_N = 64


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored (kept in the access log only)
    logit_bias: dict[str, float] | None = None
    # stopline extensions (send with the openai client's extra_body=)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    queue_timeout: float | None = None  # seconds before the first step, else 503
    deadline: float | None = None  # seconds from arrival to the end, else finish_reason "timeout"
    priority: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CancelRequest(_Strict):
    ids: list[str] | None = None  # None: every open request


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body: 400 for malformed JSON or a missing field, 422 for wrong types."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise _validation_error(exc) from None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


def _validation_error(exc: ValidationError) -> ApiError:
    errs = exc.errors()
    first = errs[0]
    path = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(path) or None
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if kind == "missing":
        return ApiError(400, f"{param}: required parameter missing", param=param, code="missing_parameter")
    if not path:
        return ApiError(400, "the body must be a JSON object", code="invalid_body")
    if kind.endswith("_type") or kind.endswith("_parsing"):
        wanted = " or ".join(dict.fromkeys(e["msg"].removeprefix("Input should be ")
                                           for e in errs if e["loc"][:1] == first["loc"][:1]))
        return ApiError(422, f"{param}: wrong type; expected {wanted}", param=param, code="invalid_type")
    return ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value")


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported")


def sampling_params(req: CompletionRequest | ChatRequest, *, default_max_tokens: int | None,
                    queue_timeout: float | None) -> SamplingParams:
    """Map a request to SamplingParams; range checks are SamplingParams.validate's job."""
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n: must be between 1 and {MAX_N}, got {req.n}", param="n")
    if req.logit_bias:
        raise _unsupported("logit_bias", "not supported")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    max_tokens = req.max_tokens
    logprobs: int | None
    if isinstance(req, ChatRequest):
        if req.tools or req.tool_choice not in (None, "none"):
            raise _unsupported("tools", "tool calling is not supported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", "only {'type': 'text'} is supported")
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.echo:
            raise _unsupported("echo", "echo is not supported")
        if req.suffix is not None:
            raise _unsupported("suffix", "suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise _unsupported("best_of", "best_of other than n is not supported")
        logprobs = req.logprobs
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    p = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        stop=stop,
        seed=req.seed,
        logprobs=logprobs,
        queue_timeout=req.queue_timeout if req.queue_timeout is not None else queue_timeout,
        deadline=req.deadline,
    )
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                 "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                 "priority"):
        value = getattr(req, name)
        if value is not None:
            setattr(p, name, value)
    if req.stop_token_ids is not None:
        p.stop_token_ids = list(req.stop_token_ids)
    return p


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content parts joined to one string."""
    if not req.messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise _unsupported(f"messages.{i}.content", f"content part type {part.type!r} "
                                       "is not supported (text only)")
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out
