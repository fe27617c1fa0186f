"""What one running server knows: its engine, settings, metrics, and how it asks to exit."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from stopline.engine.async_engine import Admission, AsyncEngine
from stopline.engine.messages import Utility
from stopline.server import reasoning
from stopline.server.errors import ApiError
from stopline.server.format import TokenText
from stopline.server.metrics import ServerMetrics
from stopline.server.store import ResponseStore

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
    reasoning_parser: str = "auto"  # server/reasoning.py `markers`
    # What a request arriving while the engine is paused or asleep gets: "queue" (it waits
    # for the resume, at most its queue timeout) or "reject" (503 with Retry-After).
    paused_admission: str = "queue"
    # A keep weight update recomputes the in-flight requests' KV under the new weights
    # (POST /update_weights's `recompute` decides for its own update).
    update_recompute: bool = False
    # /v1/responses: stored responses kept at most (oldest ended first; also the most
    # background runs at once), and seconds one is kept after it ended.
    responses_max_stored: int = 1000
    responses_ttl_s: float = 3600.0
    loras: dict[str, str] | None = None  # adapters to load at start: name -> path
    lora_unload_policy: str = "wait"  # an unload's policy when its body names none


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
        engine.update_recompute = settings.update_recompute
        self.exit_code: int | None = None
        self.request_exit: Callable[[int], None] = lambda code: None  # set by the runner
        self.created = int(time.time())
        self._token_text: TokenText | None = None
        self._markers: tuple[reasoning.Markers | None] | None = None
        self.responses = ResponseStore(settings.responses_max_stored, settings.responses_ttl_s)
        # The adapters served as models: name -> path. The core's set is the truth (it refuses
        # a request whose adapter went meanwhile); this is the front end's copy for /v1/models
        # and the 404 before anything is queued.
        self.loras: dict[str, str] = {}

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    @property
    def reasoning_markers(self) -> reasoning.Markers | None:
        """The model's thinking markers (None: it doesn't think), once the engine is up."""
        tok = self.engine.tokenizer
        if tok is None:
            return None
        if self._markers is None:
            try:
                self._markers = (reasoning.markers(self.settings.reasoning_parser, tok.chat_template),)
            except ValueError as exc:
                raise ApiError(500, str(exc), code="bad_setting") from None
        return self._markers[0]

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

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None for the base model; 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return model
        served = ", ".join(repr(m) for m in [self.model_name, *self.loras])
        raise ApiError(404, f"model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    # ---- LoRA adapters -----------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> dict:
        """Load an adapter in the core (between steps); ApiError (400 naming the problem) if
        it is refused, and nothing changes."""
        if name == self.model_name:
            raise ApiError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
        got = _one(await self.engine.utility(Utility.LOAD_LORA, name, path))
        if got["status"] != 200:
            raise ApiError(got["status"], got["message"], param="lora_path" if "already" not in
                           got["message"] else "lora_name", code="invalid_lora")
        self.loras[name] = path
        return got

    async def unload_lora(self, name: str, policy: str | None) -> dict:
        """Unload an adapter with a policy (engine/adapters.py): 404 unknown, 409 in use
        (refuse). New requests for it get 404 from now on."""
        got = _one(await self.engine.utility(Utility.UNLOAD_LORA, name,
                                             policy or self.settings.lora_unload_policy))
        if got["status"] != 200:
            code = {404: "model_not_found", 409: "lora_in_use"}.get(got["status"], "invalid_value")
            raise ApiError(got["status"], got["message"], param="lora_name" if got["status"] != 400
                           else "policy", code=code)
        self.loras.pop(name, None)
        return got

    async def _load_start_loras(self) -> bool:
        for name, path in (self.settings.loras or {}).items():
            try:
                await self.load_lora(name, path)
            except ApiError as exc:
                log.error("--lora %s=%s: %s", name, path, exc.message)
                return False
            log.info("LoRA adapter %r loaded from %s", name, path)
        return True

    # ---- engine life ------------------------------------------------------------------------
    async def start_engine(self) -> None:
        t0 = time.monotonic()
        try:
            info = await self.engine.start()
        except Exception as exc:  # noqa: BLE001 - any failure: say why and exit non-zero
            log.error("the engine failed to start: %s", exc)
            self.exit(EXIT_START_FAILED)
            return
        if not await self._load_start_loras():
            self.exit(EXIT_START_FAILED)
            return
        log.info("ready: %s (%d KV blocks of %d tokens, context %d) in %.1f s", info.source,
                 info.num_blocks, info.block_size, info.max_model_len, time.monotonic() - t0)

    def _core_died(self, reason: str) -> None:
        delay = self.settings.dead_exit_delay
        log.error("engine core died: %s. /health is unhealthy and new requests get 503; "
                  "exiting with status %d in %.1f s", reason, EXIT_CORE_DIED, delay)
        asyncio.get_running_loop().call_later(delay, self.exit, EXIT_CORE_DIED)


def _one(got: Any) -> dict:
    """A utility's answer; with replicas (a list, one per replica), the first that failed."""
    if isinstance(got, list):
        bad = [g for g in got if g["status"] != 200]
        return bad[0] if bad else got[0]
    return got
