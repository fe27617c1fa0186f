"""Engine-wide stops over HTTP (docs/engine-stops.md): pause, resume, sleep, wake_up and
update_weights. Each answers when its stop is in place, with what it did and the replicas or
roles it could not reach; bad input is a 400 before anything changes."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stopline.engine.async_engine import PauseMode
from stopline.engine.streams import EngineUnavailable
from stopline.server.errors import ApiError
from stopline.server.requests import read_body, unavailable
from stopline.server.state import ServerState


def _mode(value: str | None, default: PauseMode, allowed: tuple[PauseMode, ...] = tuple(PauseMode)) -> PauseMode:
    if value is None:
        return default
    try:
        mode = PauseMode(value)
    except ValueError:
        mode = None
    if mode not in allowed:
        raise ApiError(400, f"mode: must be one of {', '.join(m.value for m in allowed)}, got {value!r}",
                       param="mode", code="invalid_value")
    return mode


def _timeout(request: Request) -> float | None:
    raw = request.query_params.get("timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ApiError(400, f"timeout: must be a positive number of seconds, got {raw!r}",
                       param="timeout", code="invalid_value")
    return value


def install(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    async def run(request: Request, work: Callable[[], Awaitable[dict]]) -> JSONResponse:
        state.authorize(request)
        if not engine.ready:
            raise unavailable(engine.unavailable_why())
        try:
            answer = await work()
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).partition(":")[0] if ": " in str(exc) else None,
                           code="invalid_value") from None
        except TimeoutError as exc:
            raise ApiError(409, str(exc) or "the stop did not complete in time", code="stop_timeout") from None
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        return JSONResponse(answer, headers={"X-Weight-Version": str(engine.weight_version)})

    @app.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        mode = _mode(request.query_params.get("mode"), PauseMode.KEEP)
        return await run(request, lambda: engine.pause(mode, timeout=_timeout(request)))

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        return await run(request, lambda: engine.resume())

    @app.post("/sleep")
    async def sleep(request: Request) -> JSONResponse:
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise ApiError(400, f"level: must be 1 or 2, got {raw!r}", param="level", code="invalid_value")
        mode = _mode(request.query_params.get("mode"), PauseMode.ABORT, (PauseMode.ABORT, PauseMode.WAIT))
        return await run(request, lambda: engine.sleep(int(raw), mode, timeout=_timeout(request)))

    @app.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        return await run(request, lambda: engine.wake_up())

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        state.authorize(request)
        try:
            body = json.loads(await read_body(request, state.settings.max_body_bytes) or b"{}")
        except ValueError:
            raise ApiError(400, "body: must be a JSON object", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "body: must be a JSON object", code="invalid_json")
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "path: a GGUF file or an HF directory is required", param="path",
                           code="invalid_value")
        if not os.path.exists(path):
            raise ApiError(400, f"path: {path} does not exist", param="path", code="invalid_value")
        mode = _mode(body.get("mode"), PauseMode.KEEP)
        recompute = body.get("recompute")
        if recompute is not None and not isinstance(recompute, bool):
            raise ApiError(400, "recompute: must be true or false", param="recompute",
                           code="invalid_value")
        return await run(request, lambda: engine.update_weights(path, mode, timeout=_timeout(request),
                                                                recompute=recompute))
