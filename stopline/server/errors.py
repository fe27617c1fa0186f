"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, one status each.

Every error the server answers goes through `ApiError`, including FastAPI's own (unknown
route, wrong method) and unexpected exceptions, so a client never sees another shape.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("stopline.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


def param_of(message: str) -> str | None:
    """InvalidRequest messages start with the offending parameter ('max_tokens: must be ...')."""
    m = _PARAM.match(message)
    return m.group(1) if m else None


def install(app: FastAPI) -> None:
    """Route every error through ApiError."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, msg, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0]["loc"]) if errs else None
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errs)
        return ApiError(422, msg, param=loc, code="invalid_type").response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while we read its body: nothing was admitted, nobody reads the
        # answer; not an internal error (nginx's 499, "client closed request").
        return ApiError(499, "the client closed the connection before its request body arrived",
                        code="client_closed_request").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal server error: {exc!r}", code="internal_error").response()
