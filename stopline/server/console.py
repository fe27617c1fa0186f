"""The web console: a chat page at `/` and the live state of the stop path it reads.

The page is static (stopline/server/static/, no build step, nothing from outside the
package) and talks to the server only through the OpenAI endpoint and
`GET /v1/console/snapshot`. The page and its files are public; with --api-key the snapshot,
like every API route, wants the key, so without it the page is all anyone gets.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

if TYPE_CHECKING:
    from stopline.server.state import ServerState

STATIC = Path(__file__).resolve().parent / "static"
_NO_STORE = {"Cache-Control": "no-store"}


def install(app: FastAPI, state: ServerState) -> None:
    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", headers=_NO_STORE)

    @app.get("/v1/console/snapshot")
    async def snapshot(request: Request) -> Response:
        state.authorize(request)
        return Response(msgspec.json.encode(console_snapshot(state)),
                        media_type="application/json", headers=_NO_STORE)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def console_snapshot(state: ServerState) -> dict[str, Any]:
    """The engine's latest snapshot (taken after its last step: reading it never waits for a
    step) plus the frontend's recent latencies, in the shape the page draws."""
    engine, m = state.engine, state.metrics
    s = engine.snapshot
    now = time.monotonic()
    return {
        "model": state.model_name,
        "engine": (engine.state if not (engine.ready and engine.held) else
                   f"asleep (level {engine.asleep})" if engine.asleep else f"paused ({engine.paused.value})"),
        "weight_version": engine.weight_version,
        "open_streams": engine.num_open,
        # Each process the front end depends on (replicas, roles, the core process) with its
        # state: healthy, stuck (engine/liveness.py), dead, ...; empty in-process.
        "processes": engine.backend.health() if hasattr(engine.backend, "health") else [],
        # CLOCK_MONOTONIC is system-wide, so the core process's stamp compares with ours.
        "age_s": max(0.0, now - s.taken_at) if s.taken_at else None,
        "steps": s.steps,
        "pool": {"total": s.kv_blocks_total, "used": s.kv_blocks_used, "cached": s.kv_blocks_cached,
                 "free": s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached,
                 "block_size": s.block_size, "complete_map": s.pool_map,
                 "cached_ids": s.cached_block_ids,
                 # Every KV layer group's pool (the map above is group 0's): Gemma 3's local
                 # layers hold blocks for their window, its global ones for the context.
                 "groups": [{"group": g, "window": w, "total": t, "used": u, "cached": c,
                             "free": t - u - c} for g, (w, t, u, c) in enumerate(s.kv_groups)]},
        "counts": {"running": s.running, "waiting": s.waiting, "preempted": s.preempted},
        "live": [{"id": q.incarnation, "index": q.index, "state": q.state, "tokens": q.tokens,
                  "blocks": q.num_blocks, "block_ids": q.block_ids, "adapter": q.lora or "base"}
                 for q in s.live],
        # LoRA adapters: name -> references now, requests, tokens, loads, unloads, evictions, resident
        "adapters": {n: dict(zip(("references", "requests", "tokens", "loads", "unloads", "evictions",
                                  "resident"), v, strict=True))
                     for n, v in s.loras.items()},
        "finished": s.finished,
        "aborts": [{"source": src, "state": st, "n": n} for src, st, n in s.aborts],
        "preemptions": s.preemptions,
        "recomputed_tokens": s.recomputed_tokens,
        "tokens_after_abort": s.tokens_after_abort,
        "tokens_per_s": m.token_rate.rate(now),
        "ttft_s": m.recent_ttft.percentiles(),
        "itl_s": m.recent_itl.percentiles(),
        "last_aborts": [{"id": t.incarnation, "source": t.source, "accept_ms": t.accept_s * 1e3,
                         "quiet_ms": t.quiet_s * 1e3, "reclaim_ms": t.reclaim_s * 1e3}
                        for t in reversed(m.recent_aborts)],
    }
