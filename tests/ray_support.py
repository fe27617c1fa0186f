"""What the Ray checks share (tests/*_checks.py, run inside a network namespace): a local Ray
for the module, telemetry off, and an async wait for a condition."""

from __future__ import annotations

import asyncio
import time

import pytest

from stopline.cluster.frontend import quiet_ray_env


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    quiet_ray_env()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def until(cond, timeout: float, what: str) -> float:
    """Seconds until cond() holds; AssertionError(what) past timeout."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        await asyncio.sleep(0.02)
    return time.monotonic() - t0
