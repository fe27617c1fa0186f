"""Request bodies of the OpenAI-compatible API, and their mapping to SamplingParams.

Models are strict: a value of the wrong JSON type is a 422 (no "5" -> 5 coercion); a value
of the right type but out of range is a 400 from `SamplingParams.validate` or the checks
here. Unknown fields are accepted and ignored (clients send vendor fields), except those
whose silent ignoring would change the result; those are refused with a 400 (`unsupported`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from stopline.grammar import tool_format
from stopline.grammar.formats import response_format_grammar
from stopline.grammar.tools import ToolPlan, tool_plan
from stopline.request import InvalidRequest, SamplingParams
from stopline.server import limits
from stopline.server.errors import ApiError, param_of


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk


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
    response_format: dict[str, Any] | None = None  # stopline extension on completions


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Thinking models (server/reasoning.py): a budget by effort, or stopline's exact one; the
    # template's switches (vLLM's chat_template_kwargs, e.g. {"enable_thinking": false}).
    reasoning_effort: str | None = None
    max_thinking_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CancelRequest(_Strict):
    ids: list[str] | None = None  # None: every open request


class LoadLoraRequest(_Strict):  # vLLM's body
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Strict):  # vLLM's body, plus what to do with the adapter's requests
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored
    policy: str | None = None  # wait, abort or refuse; None: the server's --lora-unload-policy


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
    limits.check(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    max_tokens = req.max_tokens
    logprobs: int | None
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
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
    if req.logit_bias:
        p.logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
    if isinstance(req, CompletionRequest) and req.echo:
        # echo with logprobs scores the prompt too; max_tokens 0 then only scores it. Echo
        # alone with max_tokens 0 is scored as well (nothing else to run), its scores unsent.
        if logprobs is not None or max_tokens == 0:
            p.prompt_logprobs = logprobs or 0
    return p


def _invalid(exc: InvalidRequest) -> ApiError:
    msg = str(exc)
    return ApiError(400, msg, param=param_of(msg), code="invalid_value")


def tools_of(req: CompletionRequest | ChatRequest) -> ToolPlan:
    """The request's tools and tool_choice, checked (completions have none)."""
    if not isinstance(req, ChatRequest):
        return ToolPlan()
    try:
        return tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    except InvalidRequest as exc:
        raise _invalid(exc) from None


def grammar_of(req: CompletionRequest | ChatRequest, tools: ToolPlan) -> str | None:
    """The grammar the request's response_format or tool_choice asks for (None: free text)."""
    try:
        rf = response_format_grammar(req.response_format)
    except InvalidRequest as exc:
        raise _invalid(exc) from None
    if rf is not None and tools.grammar is not None:
        raise ApiError(400, "response_format: can't be combined with tools unless tool_choice "
                       "is 'none'", param="response_format", code="invalid_value")
    return rf if rf is not None else tools.grammar


def chat_messages(req: ChatRequest, tools: ToolPlan | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content parts joined to one string; tools
    shown in a system message, past tool calls and tool results in stopline's tool-call
    format (stopline/grammar/tool_format.py), which SmolLM2's template lacks a syntax for."""
    if not req.messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = []
    shown = tools.system_text() if tools is not None else None
    if shown is not None:
        out.append({"role": "system", "content": shown})
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
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
        if m.tool_calls:
            if role != "assistant":
                raise ApiError(400, f"messages.{i}.tool_calls: only assistant messages call tools",
                               param=f"messages.{i}.tool_calls", code="invalid_value")
            _check_calls(i, m.tool_calls)
            content = tool_format.assistant_text(content, m.tool_calls)
        elif role == "tool":
            # Shown as the user turn that brings the result back (the format's convention).
            role, content = "user", tool_format.tool_result_text(content or "")
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if shown is not None and i == 0 and role == "system":
            out[0]["content"] = f"{content}\n\n{shown}"  # one system turn: theirs, then the tools
            continue
        out.append(msg)
    return out


def _check_calls(i: int, calls: list[dict[str, Any]]) -> None:
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        param = f"messages.{i}.tool_calls.{j}"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{param}.function: must be an object with a 'name'", param=param,
                           code="invalid_value")
        args = fn.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except ValueError:
            ok = False
        if not ok:
            raise ApiError(400, f"{param}.function.arguments: must be a JSON object (as a string)",
                           param=f"{param}.function.arguments", code="invalid_value")
