"""POST /tokenize and /detokenize (vLLM's shapes), for clients that count or check tokens.

/tokenize takes `{"model", "prompt"}` or `{"model", "messages", "add_generation_prompt"}`
(the chat template applied as /v1/chat/completions would) and answers
`{"tokens", "count", "max_model_len"}`; /detokenize takes `{"model", "tokens"}` and answers
`{"prompt"}`. Neither touches the engine core: only its tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from stopline.server import limits
from stopline.server.errors import ApiError
from stopline.server.protocol import ChatMessage, _Strict, chat_messages, parse
from stopline.server.requests import read_body, unavailable
from stopline.tokenizer.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from stopline.server.state import ServerState


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


async def _ready(request: Request, body_model: type[_Strict]) -> tuple[Any, Any, ServerState]:
    srv: ServerState = request.app.state.server
    srv.authorize(request)
    req = parse(body_model, await read_body(request, srv.settings.max_body_bytes))
    srv.check_model(req.model)
    if not srv.engine.ready or srv.engine.tokenizer is None or srv.engine.info is None:
        raise unavailable(srv.engine.unavailable_why())
    return req, srv.engine.tokenizer, srv


async def tokenize(request: Request) -> dict[str, Any]:
    req, tok, srv = await _ready(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "prompt: give exactly one of prompt or messages", param="prompt",
                       code="invalid_value")
    if req.messages is not None:
        limits.check_messages(req.messages, limits.LIMITS)
        try:
            text = tok.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages", code="chat_template") from None
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": srv.engine.info.max_model_len}


async def detokenize(request: Request) -> dict[str, Any]:
    req, tok, srv = await _ready(request, DetokenizeRequest)
    vocab = srv.engine.info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens: token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})",
                       param="tokens", code="invalid_value")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
