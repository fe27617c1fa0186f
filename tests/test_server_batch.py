"""A batched request is one unit (DESIGN.md 11): several prompts in one completions request,
each with n samples, over real HTTP on loopback.

Backpressure, cancel (every endpoint), a member's engine error (streaming or not) and the
handler's early ends all reach every engine request of the response; afterwards the engine is
idle and its audit finds nothing held.

The server runs in this process (uvicorn in a thread, the engine core in its own process, as
`stopline serve` runs it), so a test can end one member's stream with `EngineDead` the way the
replicas front end does for every request of a replica that died (`AsyncEngine.fail`), and
can run the engine's audit.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.output import RequestOutput
from stopline.engine.streams import RequestStream
from stopline.request import AbortSource, FinishReason, SamplingParams, Usage
from stopline.server import batch
from stopline.server.app import build_app
from stopline.server.state import ServerSettings, ServerState
from tests.server_harness import ServerProcess, free_port, serving, total

pytestmark = pytest.mark.timeout(180)

LONG = 6000  # tokens per sample: seconds of decoding, so a member that is not ended shows
STALL = 3.0  # seconds a full stream may go unread
BUFFERED = 16  # outputs a stream holds unread before its request pauses


class _Uvicorn(uvicorn.Server):
    loop: asyncio.AbstractEventLoop

    async def startup(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)


class Live(ServerProcess):
    """The harness's metrics and idle checks, on a server running in this process."""

    def __init__(self, model_dir: str) -> None:  # noqa: D107 - no subprocess: not super()
        self.engine = AsyncEngine.in_subprocess(
            model_dir, EngineConfig(num_blocks=2048, max_num_seqs=8), progress=False,
            core_threads=1, max_buffered=BUFFERED, stall_timeout=STALL)
        self.state = ServerState(self.engine, ServerSettings(model_name="tiny"))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        self.server = _Uvicorn(uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port,
                                              log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server not ready")

    def on_loop(self, fn, *args):
        """Run fn(*args) on the server's event loop and return its result (awaited if a coroutine)."""
        async def call():
            out = fn(*args)
            return await out if asyncio.iscoroutine(out) else out
        return asyncio.run_coroutine_threadsafe(call(), self.server.loop).result(30)

    def fail(self, incarnation: str) -> None:
        """What the replicas front end does when the replica running `incarnation` dies: its
        request is gone from the engine and its stream ends with EngineDead."""
        def lost() -> None:
            self.engine.backend.abort([incarnation], AbortSource.CANCEL, time.monotonic())
            self.engine.fail([incarnation], f"replica 1 died (running {incarnation})")
        self.on_loop(lost)

    def status(self, rid: str):
        return self.on_loop(self.engine.status, rid)

    def wait_ended(self, rid: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while (status := self.status(rid)) == "open" and time.monotonic() < deadline:
            time.sleep(0.02)
        return status

    def check_clean(self) -> None:
        """Idle, every stream closed, and the audit finds no request held by anything."""
        self.wait_idle(timeout=10.0)
        assert self.on_loop(lambda: self.engine.num_open) == 0
        assert self.on_loop(self.engine.utility, "audit") is None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(tiny_long_model_dir):
    with serving(Live(str(tiny_long_model_dir))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.openai()


@pytest.fixture
def clean(live):
    live.check_clean()
    return live


def _long(**extra) -> dict:
    """The body of a long 2-prompt request."""
    return {"model": "tiny", "prompt": ["Once upon", "a time"], "max_tokens": LONG,
            "ignore_eos": True} | extra


def _create(client: openai.OpenAI, **extra):
    """The same request, streamed by the openai client."""
    return client.completions.create(model="tiny", prompt=["Once upon", "a time"], max_tokens=LONG,
                                     stream=True, extra_body={"ignore_eos": True}, **extra)


def _started(live: Live, rid: str, members: int) -> None:
    """Wait until every member of the response is open in the engine and has produced output."""
    deadline = time.monotonic() + 30
    ids = [rid] + [f"{rid}-p{k}" for k in range(1, members)]
    while time.monotonic() < deadline:
        if all(live.on_loop(lambda i=i: (s := live.engine._streams.get(i)) is not None and s.started)
               for i in ids):
            return
        time.sleep(0.01)
    raise AssertionError(f"members of {rid} not all running")


# ---- issue 41, item 2: backpressure ------------------------------------------------------------
def test_unread_batch_pauses_every_member_and_stalls_out(clean):
    """Nobody reads a 2-prompt, n=2 stream: every member fills its stream, pauses, and the
    stall timeout aborts all four samples with source `stalled`; none runs to `length`."""
    before = clean.metrics()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the socket holds little unread
    s.connect(("127.0.0.1", clean.port))
    body = json.dumps(_long(stream=True, n=2)).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        clean.wait_for(lambda m: total(m, 'stopline_aborts_total{source="stalled"')
                       - total(before, 'stopline_aborts_total{source="stalled"') >= 4, timeout=90)
        clean.wait_idle(timeout=10.0)
        after = clean.metrics()
        assert total(after, 'stopline_aborts_total{source="stalled"') == \
            total(before, 'stopline_aborts_total{source="stalled"') + 4
        assert after['stopline_request_finished_total{reason="length"}'] == \
            before['stopline_request_finished_total{reason="length"}']
    finally:
        s.close()
    clean.check_clean()


# ---- item 3: one member's engine error ends the others ----------------------------------------
def test_member_error_ends_siblings_streaming(clean, client):
    before = clean.metrics()
    stream = _create(client, n=2)
    it = iter(stream)
    rid = next(it).id
    _started(clean, rid, 2)
    clean.fail(f"{rid}-p1")
    with pytest.raises(openai.APIError, match="replica 1 died"):
        for _ in it:
            pass
    # Prompt 0's two samples were aborted by the error, not left to run until the stall timeout.
    assert clean.wait_ended(rid) == ["abort", "abort"]
    assert total(clean.metrics(), 'stopline_aborts_total{source="sibling"') == \
        total(before, 'stopline_aborts_total{source="sibling"') + 2
    clean.check_clean()


def test_member_error_ends_siblings_non_streaming(clean):
    before = clean.metrics()
    result: dict = {}

    def call() -> None:
        result["r"] = httpx.post(clean.base + "/v1/completions", json=_long(), timeout=60)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 30
    while not (rids := [i for i in clean.on_loop(clean.engine.open_ids) if i.endswith("-p1")]):
        assert time.monotonic() < deadline, "the request was not admitted"
        time.sleep(0.01)
    rid = rids[0].removesuffix("-p1")
    _started(clean, rid, 2)
    clean.fail(f"{rid}-p1")
    t.join(30)
    r = result["r"]
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
    # Prompt 0 was aborted by its sibling's error, not left to run until the stall timeout.
    assert clean.wait_ended(rid) == ["abort"]
    assert total(clean.metrics(), 'stopline_aborts_total{source="sibling"') == \
        total(before, 'stopline_aborts_total{source="sibling"') + 1
    clean.check_clean()


# ---- item 4 and the cancel endpoints -----------------------------------------------------------
def test_bulk_cancel_by_response_id_ends_every_prompt(clean, client):
    stream = _create(client, n=2, logprobs=0, stream_options={"include_usage": True})
    it = iter(stream)
    chunks = [next(it)]
    rid = chunks[0].id
    _started(clean, rid, 2)
    r = httpx.post(clean.base + "/v1/requests/cancel", json={"ids": [rid]}, timeout=30)
    assert r.status_code == 200, r.text
    chunks += list(it)
    # The same stream ends at once, every choice with abort: prompt 1's too.
    reasons = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert reasons == dict.fromkeys(range(4), "abort")
    # Its usage counts every prompt's tokens, exactly those the client received.
    got = sum(len(ch.logprobs.tokens) for c in chunks for ch in c.choices if ch.logprobs)
    assert chunks[-1].usage.completion_tokens == got > 0
    answer = r.json()
    assert answer["cancelled"] == [rid] and answer["unknown"] == []
    assert answer["finish_reasons"] == {rid: ["abort"] * 4}
    clean.check_clean()


def test_cancel_answers_name_every_choice_of_the_response(clean, client):
    """The single-id endpoint reports every choice; cancel-all names response ids, once each."""
    one = iter(_create(client))
    rid = next(one).id
    _started(clean, rid, 2)
    r = httpx.post(f"{clean.base}/v1/requests/{rid}/cancel", timeout=30).json()
    assert r["cancelled"] is True and r["finish_reasons"] == ["abort", "abort"]
    list(one)

    two = iter(_create(client))
    rid = next(two).id
    _started(clean, rid, 2)
    r = httpx.post(clean.base + "/v1/requests/cancel", json={}, timeout=30).json()
    assert r["cancelled"] == [rid] and r["finish_reasons"] == {rid: ["abort", "abort"]}
    list(two)
    clean.check_clean()


def test_cancelling_one_member_ends_the_response(clean, client):
    """A member cancelled by its own id (`{id}-p1`) takes the whole response with it."""
    it = iter(_create(client))
    rid = next(it).id
    _started(clean, rid, 2)
    r = httpx.post(f"{clean.base}/v1/requests/{rid}-p1/cancel", timeout=30).json()
    assert r["cancelled"] is True
    reasons = {ch.index: ch.finish_reason for c in it for ch in c.choices if ch.finish_reason}
    assert reasons == {0: "abort", 1: "abort"}
    clean.check_clean()


def test_disconnect_ends_every_member(clean):
    """A client that closes a 2-prompt stream mid-way: every sample is aborted (disconnect)."""
    before = clean.metrics()
    with httpx.stream("POST", clean.base + "/v1/completions", json=_long(stream=True, n=2),
                      timeout=30) as r:
        lines = r.iter_lines()
        rid = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])["id"]
        _started(clean, rid, 2)
    assert clean.wait_ended(rid) == ["abort", "abort"]
    assert clean.wait_ended(f"{rid}-p1") == ["abort", "abort"]
    clean.wait_idle(timeout=10.0)
    assert total(clean.metrics(), 'stopline_aborts_total{source="disconnect"') == \
        total(before, 'stopline_aborts_total{source="disconnect"') + 4
    clean.check_clean()


def test_an_output_read_ahead_is_not_handed_out_after_a_cancel(clean):
    """The group holds one output of each prompt ahead of its reader. Once the requests are
    cancelled it hands none of those out (no token after a cancel, DESIGN.md 3), and each
    terminal's usage counts what the reader got."""
    async def run() -> tuple[list, list]:
        eng = clean.engine
        prompt = eng.tokenizer.encode("hello")
        group = batch.Group(eng, 2)
        rid = f"ahead-{time.monotonic_ns()}"
        for k in range(2):
            inc = batch.member_id(rid, k)
            group.add(await eng.add(inc, prompt, SamplingParams(n=2, max_tokens=LONG, ignore_eos=True),
                                    incarnation=inc))
        it = group.__aiter__()
        before = [await it.__anext__()]
        while not all(s.started for s in group.streams):
            before.append(await it.__anext__())
        await asyncio.sleep(0.2)  # every member's read ahead holds an output by now
        eng.abort([s.incarnation for s in group.streams], AbortSource.CANCEL, time.monotonic())
        after = []
        try:
            while True:
                after.append(await it.__anext__())
        except StopAsyncIteration:
            pass
        group.close()
        return before, after

    before, after = clean.on_loop(run)
    assert len(after) == 4 and all(o.finished and o.finish_reason == "abort" for o in after)
    assert not any(o.new_token_ids for o in after)
    for o in after:  # usage: exactly the tokens handed out before the cancel
        got = sum(len(b.new_token_ids) for b in before if b.index == o.index)
        assert o.usage.completion_tokens == got, (o.index, o.usage, got)
    clean.check_clean()


def test_a_sample_error_ends_its_family_and_stays_an_error():
    """n = 2 and one sample fails in the engine (an n > 1 family is a group too): the group
    aborts the family's other sample at once (source `sibling`), and the failed sample still
    reads as `error`, though its earlier tokens were unread when the abort went out. Without a
    model: the engine here only records aborts."""
    async def run() -> tuple[list, list[RequestOutput]]:
        aborted: list = []

        class Engine:
            def abort(self, incs, source, t0=None):
                aborted.append((list(incs), source))
                stream.cancel(source)

        stream = RequestStream("r", 2, 3, time.monotonic())
        group = batch.Group(Engine(), 2)
        group.add(stream)
        for i in (0, 1):
            stream.push(RequestOutput("r", i, "r", new_token_ids=[7], new_text="x"))
        stream.push(RequestOutput("r", 1, "r", finished=True, finish_reason=FinishReason.ERROR,
                                  stop_detail="output processing failed", usage=Usage(3, 1)))
        assert aborted == [(["r"], AbortSource.SIBLING)]
        stream.push(RequestOutput("r", 0, "r", finished=True, finish_reason=FinishReason.ABORT,
                                  stop_detail="sibling", usage=Usage(3, 1)))
        outs = []
        async for out in group:
            outs.append(out)
        return aborted, outs

    aborted, outs = asyncio.run(run())
    assert len(aborted) == 1  # once, not again for each terminal
    ends = {o.index: (o.finish_reason, o.stop_detail, o.usage.completion_tokens) for o in outs}
    assert ends == {1: (FinishReason.ERROR, "output processing failed", 0),
                    0: (FinishReason.ABORT, "sibling", 0)}
    assert not any(o.new_token_ids for o in outs)  # nothing after the abort
