"""A paused request (its client's stream is full) that is preempted under pool pressure waits
for its reader: it takes no step while paused, does not hold back the requests behind it,
is never ended by preemption (only the stall timeout ends a slow reader), and resumes exactly
once its client reads again (issue 41, item 1)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import pytest

from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, RequestStatus, SamplingParams
from stopline.server.app import build_app
from stopline.server.state import ServerSettings, ServerState
from tests.engine_support import Result, collect, record_plans, sharp_tiny_dir

PROMPT = [5, 17, 99, 23, 42, 7, 300, 12, 9, 81]
OTHERS = [[11, 29, 31, 47, 53, 61], [71, 73, 79, 83, 89, 97]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(sharp_tiny_dir(tmp_path_factory)), progress=False)


def config(**kw) -> EngineConfig:
    # 12 blocks of 4 tokens: the two others (5 blocks each at their end) fit together, but not
    # beside the slow reader's blocks. The priority policy makes the slow reader the victim;
    # no lookahead, so the two are admitted at once.
    cfg = dict(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               debug=True, target_step_ms=None, victim_policy="priority", admission_lookahead=0)
    cfg.update(kw)
    return EngineConfig(**cfg)


def engine(tiny, **kw) -> EngineCore:
    return EngineCore(tiny, config(**kw))


def slow_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, priority=1)


def other_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def step(eng: EngineCore, res: dict[tuple[str, int], Result]) -> None:
    collect(res, eng.step())
    eng.audit()


def solo_tokens(tiny) -> list[int]:
    eng = engine(tiny, num_blocks=64)
    eng.add_request("slow", PROMPT, slow_params())
    res: dict[tuple[str, int], Result] = {}
    while eng.has_unfinished():
        step(eng, res)
    return res[("slow", 0)].token_ids


def pause_under_pressure(eng: EngineCore, res: dict[tuple[str, int], Result], plans: list) -> tuple[str, int]:
    """Start the slow reader, pause it after a few tokens, then add two others that need its
    blocks; run until they end. Returns its incarnation and the index in `plans` (from
    record_plans) of the first step after the pause took effect."""
    inc = eng.add_request("slow", PROMPT, slow_params())
    for _ in range(3):
        step(eng, res)
    eng.pause(inc)
    step(eng, res)  # the pause applies at this step's boundary, before its plan
    since = len(plans) - 1
    for i, p in enumerate(OTHERS):
        eng.add_request(f"o{i}", p, other_params())
    slow = eng.families.get(inc).members[0]
    preempted = False
    while any(res.get((f"o{i}", 0), Result()).finish_reason is None for i in range(len(OTHERS))):
        step(eng, res)
        out = res.get(("slow", 0), Result())
        assert out.finish_reason is None, f"the slow reader was ended: {out.stop_detail}"
        preempted |= slow.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
    assert preempted, "the pool never forced the paused request out"
    assert eng.lifecycle.stats.preemptions, "no preemption happened"
    return inc, since


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_paused_victim_takes_no_step_and_resumes_exactly(tiny, mode):
    eng = engine(tiny, preemption_mode=mode, max_preemptions=100)
    plans = record_plans(eng)
    res: dict[tuple[str, int], Result] = {}
    inc, since = pause_under_pressure(eng, res, plans)
    slow = eng.families.get(inc).members[0]
    for i in range(len(OTHERS)):
        assert res[(f"o{i}", 0)].finish_reason is FinishReason.LENGTH
        assert len(res[(f"o{i}", 0)].token_ids) == 14
    # A request behind the waiting slow reader is admitted and runs to its end.
    eng.add_request("late", OTHERS[0], other_params())
    while res.get(("late", 0), Result()).finish_reason is None:
        step(eng, res)
    # Not one prefill, recompute, swap-in or decode while paused.
    assert not any(rid == "slow" for plan in plans[since:] for rid, *_ in plan), \
        "a paused request took a step"
    assert slow.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
    got = len(res[("slow", 0)].token_ids)
    eng.pause(inc, False)  # its client reads again
    while eng.has_unfinished():
        step(eng, res)
    out = res[("slow", 0)]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.token_ids == solo_tokens(tiny), "resumed output differs from its solo run"
    assert got < len(out.token_ids)
    assert eng.pool.num_used == 0 and not eng.families


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_slow_reader_is_not_ended_by_preemption(tiny, mode):
    # max_preemptions=0: any preemption that counted would end the request with "preempted".
    eng = engine(tiny, preemption_mode=mode, max_preemptions=0)
    res: dict[tuple[str, int], Result] = {}
    inc, _ = pause_under_pressure(eng, res, record_plans(eng))
    slow = eng.families.get(inc).members[0]
    assert slow.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
    # Only the stall timeout ends a slow reader (the async engine sends this abort).
    eng.abort([inc], AbortSource.STALLED, time.monotonic())
    while eng.has_unfinished():
        step(eng, res)
    out = res[("slow", 0)]
    assert out.finish_reason is FinishReason.ABORT and out.stop_detail == "stalled"
    assert out.token_ids == solo_tokens(tiny)[:len(out.token_ids)]
    assert eng.lifecycle.stats.finished.get("preempted", 0) == 0
    assert eng.pool.num_used == 0 and not eng.families
    if mode == "swap":
        assert eng.kv_manager.swap.num_used == 0


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stream_that_stops_reading_under_pressure_resumes_exactly(tmp_path_factory, mode):
    """Through the async engine's streams: the slow reader's stream fills, the engine pauses
    its request, the others' pressure preempts it; it is still live when they end, and
    reading it again gives exactly its solo output, nothing twice."""
    async def run() -> None:
        engine = AsyncEngine.in_process(str(sharp_tiny_dir(tmp_path_factory)),
                                        config(preemption_mode=mode, max_preemptions=0),
                                        progress=False, max_buffered=2, stall_timeout=60.0)
        await engine.start()
        core = engine.backend.loop.core
        # The pause races the core's steps (a message over ZMQ, a call here): hold the core
        # before the slow reader's third step until its stream is full (the pause is then in
        # the core's inbox) and the others are added together.
        go = threading.Event()

        def hold() -> None:
            fam = core.families.get("slow")
            if fam is not None and len(fam.members[0].output_token_ids) >= 2:
                go.wait(30)

        engine.backend.loop.before_step = hold
        try:
            slow = await engine.add("slow", PROMPT, slow_params(), incarnation="slow")
            await asyncio.wait_for(until(lambda: slow.full), 30)
            others = [await engine.add(f"o{i}", p, other_params(), incarnation=f"o{i}")
                      for i, p in enumerate(OTHERS)]
            go.set()

            async def read(stream) -> list:
                return [out async for out in stream]

            for outs in await asyncio.gather(*(read(o) for o in others)):  # read as they come
                assert outs[-1].finish_reason is FinishReason.LENGTH
            fam = core.families.get("slow")
            assert fam is not None, f"the slow reader was ended: {slow.finish_reasons}"
            req = fam.members[0]
            assert req.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED), req.status
            assert req.paused and not slow.done.done()
            got: list[int] = []
            async for out in slow:  # its client reads again
                got += out.new_token_ids
                if out.finished:
                    assert out.finish_reason is FinishReason.LENGTH, out.stop_detail
            solo = await engine.add("solo", PROMPT, slow_params(), incarnation="solo")
            want = [t async for out in solo for t in out.new_token_ids]
            assert got == want, "resumed output differs from its solo run"
            assert await engine.utility("audit") is None
        finally:
            await engine.close()

    asyncio.run(run())


async def post(app, path: str, body: dict, reading: asyncio.Event | None = None) -> tuple[int, bytes]:
    """POST to the ASGI app as a connected client; until `reading` is set, the client reads
    nothing (the server's first write of the body blocks, as on a full socket)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())]}
    asked = False
    connected = asyncio.Event()  # never set: the client stays connected
    status, chunks = 0, []

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": data, "more_body": False}
        await connected.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            if reading is not None:
                await reading.wait()
            chunks.append(msg.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_server_stream_that_stops_reading_under_pressure_resumes(tmp_path_factory, mode):
    """The HTTP layer: an SSE stream whose client stops reading is paused, preempted by the
    others' growth, and when its client reads again it ends with `length` and the text of
    its solo run, each piece once."""
    async def run() -> None:
        engine = AsyncEngine.in_process(str(sharp_tiny_dir(tmp_path_factory)),
                                        config(preemption_mode=mode, max_preemptions=0),
                                        progress=False, max_buffered=2, stall_timeout=60.0)
        app = build_app(ServerState(engine, ServerSettings(model_name="tiny")))
        await engine.start()
        core = engine.backend.loop.core
        # Hold the core once the slow stream has three outputs (one taken by the blocked
        # writer, two unread: full) until the others are in.
        go = threading.Event()

        def hold() -> None:
            if any(len(r.output_token_ids) >= 3 for r in core.live_requests()):
                go.wait(30)

        engine.backend.loop.before_step = hold
        req = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
        reading = asyncio.Event()
        try:
            slow = asyncio.create_task(post(app, "/v1/completions", req | dict(stream=True, priority=1),
                                            reading))
            await asyncio.wait_for(until(lambda: any(s.full for s in engine._streams.values())), 30)
            others = [asyncio.create_task(post(app, "/v1/completions", dict(
                model="tiny", prompt=p, max_tokens=14, temperature=0.0, ignore_eos=True)))
                for p in OTHERS]
            await asyncio.wait_for(until(lambda: engine.num_open == 3), 30)
            go.set()
            for status, body in await asyncio.gather(*others):
                assert status == 200, body
                assert json.loads(body)["choices"][0]["finish_reason"] == "length"
            assert not slow.done()
            live = core.live_requests()
            assert len(live) == 1, "the slow stream's request was ended while its client was slow"
            live = live[0]
            assert live.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED) and live.paused
            reading.set()  # the client reads again
            status, body = await asyncio.wait_for(slow, 60)
            assert status == 200
            events = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), chunks
            text = "".join(ch["text"] for c in chunks for ch in c["choices"])
            reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
            assert reasons == ["length"]
            status, body = await post(app, "/v1/completions", req)
            assert status == 200
            assert text == json.loads(body)["choices"][0]["text"], "resumed stream differs from its solo run"
            assert sum(core.lifecycle.stats.preemptions.values()) >= 1
            assert await engine.utility("audit") is None
        finally:
            await engine.close()

    asyncio.run(run())
