"""The FastAPI app: routes of the OpenAI-compatible API, Anthropic's /v1/messages
(anthropic.py), health, metrics, cancel and the web console (console.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from stopline import __version__
from stopline.request import AbortSource
from stopline.server import anthropic, batch, console, errors, memtrace, responses, stops, tokenize
from stopline.server.errors import ApiError
from stopline.server.protocol import CancelRequest, LoadLoraRequest, UnloadLoraRequest, parse
from stopline.server.requests import read_body, unavailable
from stopline.server.serving import create
from stopline.server.state import ServerState

CANCEL_TIMEOUT = 30.0  # a confirmed cancel waits at most this long for the request to end


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Load in the background: the server listens (and /health says 503) while it loads.
        loading = asyncio.create_task(state.start_engine(), name="stopline-start")
        yield
        loading.cancel()
        # Background responses still going end as failed (shutdown), before the engine goes.
        await state.responses.close("the server shut down")
        await state.engine.close()

    app = FastAPI(title="stopline", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    errors.install(app)
    console.install(app, state)
    memtrace.install(app)  # STOPLINE_TRACEMALLOC only
    stops.install(app, state)  # pause, resume, sleep, wake_up, update_weights
    responses.install(app, state)  # /v1/responses (responses.py)
    engine = state.engine

    @app.get("/health")
    async def health() -> Response:
        # Replicas (stopline/cluster) report each one; serving needs one healthy replica. The
        # roles of --disagg (stopline/disagg) report each one too; serving needs both; the
        # engine-core process is one role ("core"). A stuck one (engine/liveness.py) has
        # state "stuck" and its why in last_error.
        parts = engine.backend.health() if hasattr(engine.backend, "health") else None
        roles = parts is not None and bool(parts) and "role" in parts[0]
        extra = {} if parts is None else {"roles" if roles else "replicas": parts}
        healthy = [r["state"] == "healthy" for r in parts or ()]
        if engine.ready and engine.held:
            # Paused or asleep (docs/engine-stops.md): up, but not serving. Requests queue
            # (200: keep it in rotation) or get 503 (--paused-admission reject: take it out).
            held = {"status": "asleep" if engine.asleep else "paused", "detail": engine.unavailable_why(),
                    "paused": engine.paused.value if engine.paused else None, "asleep": engine.asleep,
                    "admission": engine.admission.value, "weight_version": engine.weight_version} | extra
            reject = engine.admission.value == "reject"
            return JSONResponse(held, status_code=503 if reject else 200,
                                headers={"Retry-After": "1"} if reject else None)
        if engine.ready and (parts is None or (all(healthy) if roles else any(healthy))):
            return JSONResponse({"status": "ok", "weight_version": engine.weight_version} | extra)
        dead = [r for r in parts or () if roles and r["state"] != "healthy"]
        detail = (engine.unavailable_why() if not engine.ready
                  else f"the {dead[0]['role']} engine is {dead[0]['state']}: {dead[0]['last_error']}"
                  if dead else "no replica is healthy")
        return JSONResponse({"status": engine.state.value if not engine.ready else "unavailable",
                             "detail": detail} | extra,
                            status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    def card() -> dict:
        out = {"id": state.model_name, "object": "model", "created": state.created,
               "owned_by": "stopline"}
        if engine.info is not None:
            out["max_model_len"] = engine.info.max_model_len
        return out

    def lora_card(name: str) -> dict:
        return card() | {"id": name, "parent": state.model_name, "root": state.loras[name]}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        state.authorize(request)
        return {"object": "list", "data": [card(), *(lora_card(n) for n in sorted(state.loras))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        state.authorize(request)
        lora = state.check_model(model_id)
        return card() if lora is None else lora_card(lora)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        """vLLM's body: {lora_name, lora_path}. 400 naming the problem if the adapter is bad."""
        state.authorize(request)
        req = parse(LoadLoraRequest, await read_body(request, state.settings.max_body_bytes))
        _ready(engine)
        got = await state.load_lora(req.lora_name, req.lora_path)
        return {"object": "lora_adapter", "id": req.lora_name, "status": "loaded",
                "message": got["message"]}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        """vLLM's body: {lora_name}; `policy` (wait, abort, refuse) is stopline's."""
        state.authorize(request)
        req = parse(UnloadLoraRequest, await read_body(request, state.settings.max_body_bytes))
        _ready(engine)
        got = await state.unload_lora(req.lora_name, req.policy)
        return {"object": "lora_adapter", "id": req.lora_name,
                "status": "unloading" if got.get("pending") else "unloaded", "message": got["message"]}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return await tokenize.tokenize(request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return await tokenize.detokenize(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create(request, chat=True)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await anthropic.messages(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await anthropic.count_tokens(request)

    @app.post("/v1/requests/cancel")
    async def cancel_many(request: Request) -> dict:
        """Admin: cancel every open request, or the listed ones; answers when all have ended."""
        state.authorize(request)
        req = parse(CancelRequest, await read_body(request, state.settings.max_body_bytes))
        # A response id stands for every engine request of its response (several prompts),
        # as in cancel_one; the answer names response ids.
        asked = list(dict.fromkeys(req.ids)) if req.ids is not None else \
            list(dict.fromkeys(batch.response_id(i, engine.status) for i in engine.open_ids()))
        group = {rid: batch.members(rid, engine.status) for rid in asked}
        ended = await engine.abort_and_wait([m for ids in group.values() for m in ids],
                                            AbortSource.CANCEL, timeout=CANCEL_TIMEOUT)
        hit = {rid: batch.reasons(ids, ended, engine.status) for rid, ids in group.items()
               if any(m in ended for m in ids)}
        others = [rid for rid in asked if rid not in hit]
        return {
            "object": "request.cancel.list",
            "cancelled": [rid for rid, reasons in hit.items() if "abort" in reasons],
            "finish_reasons": hit,
            "already_finished": {i: engine.status(i) for i in others if engine.status(i) is not None},
            "unknown": [i for i in others if engine.status(i) is None],
        }

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_one(request_id: str, request: Request) -> dict:
        """Cancel one request by the id of its response; answers when it has ended."""
        state.authorize(request)
        status = engine.status(request_id)
        if status is None:
            raise ApiError(404, f"no request with id {request_id!r} (unknown, or ended long ago)",
                           param="request_id", code="request_not_found")
        ids = batch.members(request_id, engine.status)  # several prompts: one id each
        was_open = any(engine.status(i) == "open" for i in ids)
        ended = await engine.abort_and_wait(ids, AbortSource.CANCEL, timeout=CANCEL_TIMEOUT) \
            if was_open else {}  # already over: nothing to do, nothing changes
        reasons = batch.reasons(ids, ended, engine.status)  # every choice of the response
        return {"id": request_id, "object": "request.cancel",
                "cancelled": was_open and "abort" in reasons, "finish_reasons": reasons}

    return app


def _ready(engine) -> None:  # noqa: ANN001 - the AsyncEngine
    if not engine.ready:
        raise unavailable(engine.unavailable_why())
