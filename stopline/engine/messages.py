"""Typed messages between the frontend and the engine core (msgspec structs).

The in-process mode passes `Batch` objects as they are; the two-process mode encodes every
message with msgpack. Frontend -> core messages travel on two sockets: `AbortMsg` alone on
the priority socket, everything else on the input socket, so an abort is never queued behind
a burst of adds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from stopline.config import Choice
from stopline.engine.output import RequestOutput
from stopline.engine.snapshot import Snapshot
from stopline.request import AbortSource, SamplingParams


class AbortTiming(msgspec.Struct, frozen=True):
    """How long one abort took, each measured from `t0` (the disconnect or the cancel call)."""

    incarnation: str
    source: str
    accept_s: float  # -> the engine core recorded the abort
    quiet_s: float  # -> its terminal output left the core: it computes nothing more
    reclaim_s: float  # -> the first step boundary with its KV blocks back in the pool


class CoreInfo(msgspec.Struct, frozen=True):
    """What the frontend learns about the loaded model once the core is ready."""

    source: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    load_seconds: float
    tokenizer_state: dict[str, Any]
    pid: int = 0  # the core's process (on its own host when it is remote)


# ---- frontend -> core -------------------------------------------------------------------
class AddMsg(msgspec.Struct, tag="add"):
    request_id: str
    incarnation: str  # minted by the frontend: aborts may name it before the add arrives
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() of the frontend (the clock is shared by processes)


class AbortMsg(msgspec.Struct, tag="abort"):
    incarnations: list[str]
    source: AbortSource
    t0: float  # time.monotonic() of the disconnect or cancel call


class PauseMsg(msgspec.Struct, tag="pause"):
    """The frontend's stream of these requests is full (paused) or drained again."""

    incarnations: list[str]
    paused: bool


class Utility(Choice):
    """Calls the frontend may make into the core, run between steps."""

    SNAPSHOT = "snapshot"
    AUDIT = "audit"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    TRANSFERS = "transfers"  # the KV transfers a disaggregated role timed (None elsewhere)
    # Engine-wide stops (docs/engine-stops.md), each run between steps:
    HALT = "halt"  # args {"on": bool}: no step runs while on (pause mode keep); aborts still apply
    SLEEP = "sleep"  # args {"level": 1|2}: free the KV pool (and prefix cache); 2: the weights too
    WAKE = "wake"  # allocate what sleep freed (level 2: reload the weights from their path)
    STAGE_WEIGHTS = "stage_weights"  # args {"path"}: load and check new weights; nothing changes
    # serve the staged weights; returns the new version (args {"version"}: that one, a
    # restarted part catching up)
    COMMIT_WEIGHTS = "commit_weights"
    DROP_STAGED = "drop_staged"  # forget staged weights (an update that did not go through)
    LOAD_LORA = "load_lora"  # args: name, path -> {'status', 'message'} (engine/adapters.py)
    UNLOAD_LORA = "unload_lora"  # args: name, policy -> {'status', 'message'}
    LORAS = "loras"  # the adapters loaded: name -> (path, references)
    # args {"top"}: the allocation sites of this process that grew since the last call
    # (engine/memtrace.py; only where STOPLINE_TRACEMALLOC was set when it started)
    TRACEMALLOC = "tracemalloc"


Missed = Callable[[], list[tuple[Utility, dict[str, Any] | None]]]


async def catch_up(missed: Missed, call: Callable[..., Awaitable[Any]]) -> None:
    """Bring a replica or role that (re)started up to the engine-wide state before it serves:
    `missed()` (AsyncEngine.missed) lists the utility calls that get a fresh part there (the
    current weights and their version, sleep, halt); `call(method, *args)` runs one on that
    part. Run again if a stop changed the state meanwhile (every call is idempotent)."""
    done = None
    for _ in range(3):
        calls = missed()
        if calls == done:
            return
        for method, args in calls:
            got = await call(method, *([args] if args is not None else []))
            if isinstance(got, dict) and "error" in got:
                raise RuntimeError(f"{method.value}: {got['error']}")
        done = calls


class UtilityMsg(msgspec.Struct, tag="utility"):
    call_id: int
    method: Utility
    args: list[Any] = []


class ShutdownMsg(msgspec.Struct, tag="shutdown"):
    pass


class PingMsg(msgspec.Struct, tag="ping"):
    """A heartbeat (engine/liveness.py), on the abort socket: the input thread answers it
    as it would take an abort."""

    seq: int


ToCore = AddMsg | AbortMsg | PauseMsg | UtilityMsg | ShutdownMsg | PingMsg


# ---- core -> frontend -------------------------------------------------------------------
class ReadyMsg(msgspec.Struct, tag="ready"):
    info: CoreInfo


class AddReply(msgspec.Struct, tag="add_reply"):
    incarnation: str
    error: str | None = None  # the InvalidRequest message when the core refused it


class Batch(msgspec.Struct, tag="batch"):
    """Everything one engine step produced, plus the state it left behind."""

    outputs: list[RequestOutput] = msgspec.field(default_factory=list)
    timings: list[AbortTiming] = msgspec.field(default_factory=list)
    snapshot: Snapshot | None = None
    # Incarnations whose prompt KV this core took from another process (a split's decode
    # role): the front end no longer needs their sender.
    taken: list[str] = msgspec.field(default_factory=list)


class UtilityReply(msgspec.Struct, tag="utility_reply"):
    call_id: int
    result: Any = None
    error: str | None = None


class FatalMsg(msgspec.Struct, tag="fatal"):
    message: str


class PongMsg(msgspec.Struct, tag="pong"):
    seq: int
    step_age: float  # seconds inside the current step (0: between steps)


FromCore = ReadyMsg | AddReply | Batch | UtilityReply | FatalMsg | PongMsg
