"""What one running server knows: its engine, settings, metrics, and how it asks to exit."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from stopline.engine.async_engine import Admission, AsyncEngine
from stopline.server.errors import ApiError
from stopline.server.format import TokenText
from stopline.server.metrics import ServerMetrics

log = logging.getLogger("stopline.server")

EXIT_START_FAILED = 1
EXIT_CORE_DIED = 3


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    queue_timeout: float | None = None  # default per-request queue timeout (seconds)
    drain_timeout: float = 30.0  # SIGTERM: how long running requests may finish
    # After the engine core dies: keep answering (503, /health unhealthy) this long so that
    # open streams get their error event and probes see why, then exit EXIT_CORE_DIED.
    dead_exit_delay: float = 2.0
    # What a request arriving while the engine is paused or asleep gets: "queue" (it waits
    # for the resume, at most its queue timeout) or "reject" (503 with Retry-After).
    paused_admission: str = "queue"


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.metrics.bind(engine)
        engine.observer = self.metrics
        engine.on_dead.append(self._core_died)
        engine.admission = Admission(settings.paused_admission)
        self.exit_code: int | None = None
        self.request_exit: Callable[[int], None] = lambda code: None  # set by the runner
        self.created = int(time.time())
        self._token_text: TokenText | None = None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    def exit(self, code: int) -> None:
        """Ask the server to stop and exit with `code` (the first code asked for wins)."""
        if self.exit_code is None:
            self.exit_code = code
        self.request_exit(self.exit_code)

    # ---- checks ---------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    # ---- engine life ------------------------------------------------------------------------
    async def start_engine(self) -> None:
        t0 = time.monotonic()
        try:
            info = await self.engine.start()
        except Exception as exc:  # noqa: BLE001 - any failure: say why and exit non-zero
            log.error("the engine failed to start: %s", exc)
            self.exit(EXIT_START_FAILED)
            return
        log.info("ready: %s (%d KV blocks of %d tokens, context %d) in %.1f s", info.source,
                 info.num_blocks, info.block_size, info.max_model_len, time.monotonic() - t0)

    def _core_died(self, reason: str) -> None:
        delay = self.settings.dead_exit_delay
        log.error("engine core died: %s. /health is unhealthy and new requests get 503; "
                  "exiting with status %d in %.1f s", reason, EXIT_CORE_DIED, delay)
        asyncio.get_running_loop().call_later(delay, self.exit, EXIT_CORE_DIED)
