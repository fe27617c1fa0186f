"""The front end's engine: the server's unchanged AsyncEngine over RayCores.

`stopline serve --replicas N` builds its engine here; the OpenAI app, its cancel paths
(disconnect, cancel calls, deadlines, shutdown drain) and its metrics then work through the
router as they do in one process.
"""

from __future__ import annotations

import os
from typing import Any

from stopline.cluster.cores import RayCores
from stopline.cluster.router import Policy
from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.liveness import Bounds
from stopline.request import AbortSource


def quiet_ray_env() -> None:
    """Set before Ray starts: it must not report usage anywhere; and a call to a replica that
    died fails after 100 ms of waiting for the death's cause (Ray's default is a second),
    so the dead replica's streams end well within a second."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "100")


def ray_engine(model: str | None, config: EngineConfig | None, *, replicas: int = 2,
               address: str | None = None, policy: Policy | str = Policy.AFFINITY,
               threads: int | None = 1, num_cpus: float = 1.0,
               ray_init: dict[str, Any] | None = None, liveness: Bounds | None = None,
               **streams: Any) -> AsyncEngine:
    """An AsyncEngine whose core is `replicas` Ray actors (one engine core each)."""
    quiet_ray_env()
    backend = RayCores(model, config, replicas=replicas, address=address, policy=Policy(policy),
                       threads=threads, num_cpus=num_cpus, ray_init=ray_init, liveness=liveness)
    engine = AsyncEngine(backend, **streams)
    backend.on_lost = lambda incs, why: engine.fail(incs, why, AbortSource.REPLICA)
    return engine
