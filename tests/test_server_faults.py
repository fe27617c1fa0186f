"""The server when things go wrong: the engine-core process dies, the queue is full, SIGTERM.

Each scenario needs a server of its own (a killed core or a drained server is gone for good).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, raw_request, serving

pytestmark = pytest.mark.timeout(120)


def test_core_killed_during_8_streams(tiny_model_dir):
    srv = ServerProcess("--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--num-blocks", "256", "--max-num-seqs", "8")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)
        n = 8
        streaming = threading.Barrier(n + 1)
        ended: list[tuple[float, BaseException | None]] = [(0.0, None)] * n

        def one(i: int) -> None:
            got_first = False
            try:
                for ch in client.completions.create(model="tiny", prompt=f"story {i}", max_tokens=900,
                                                    stream=True, extra_body={"ignore_eos": True}):
                    if not got_first and ch.choices and ch.choices[0].text:
                        got_first = True
                        streaming.wait(30)
                ended[i] = (time.monotonic(), None)
            except Exception as exc:  # the error event surfaces as an exception
                ended[i] = (time.monotonic(), exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        streaming.wait(30)  # every stream is receiving tokens
        t_kill = time.monotonic()
        os.kill(srv.core_pid(), signal.SIGKILL)
        for t in threads:
            t.join(10)
        for t_end, exc in ended:
            assert isinstance(exc, openai.APIError), exc
            assert "engine core died" in str(exc)
            assert t_end - t_kill < 1.0, t_end - t_kill
        health = httpx.get(srv.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert srv.metrics()["stopline_engine_healthy"] == 0
        # Then the server exits non-zero on its own (status 3: engine core died).
        assert srv.proc.wait(15) == 3
        assert "engine core died" in srv.output()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def inproc(tiny_long_model_dir):
    """In-process mode (the core steps in a thread of the server), one request at a time.

    Its model has a long context, so that a request can outlast the drain timeout on any machine.
    """
    with serving(ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny", "--in-process",
                               "--num-blocks", "2048", "--max-num-seqs", "4", "--max-waiting", "1",
                               "--drain-timeout", "1.0")) as srv:
        yield srv


def _stream_lines(base: str, body: dict, out: list, first: threading.Event) -> None:
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                first.set()
            elif line == "data: [DONE]":
                out.append("[DONE]")


def test_in_process_disconnect_and_queue_full(inproc):
    # A disconnect aborts in this mode too.
    sock = raw_request(inproc.port, "/v1/completions", json.dumps(
        {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}).encode())
    inproc.wait_for(lambda m: m["stopline_requests_running"] == 1)
    sock.close()
    inproc.wait_idle(timeout=1.0)
    assert inproc.metrics()['stopline_aborts_total{source="disconnect",state="running"}'] + \
        inproc.metrics()['stopline_aborts_total{source="disconnect",state="prefilling"}'] == 1
    # 4 running, 1 waiting for its first step: the next request is refused with 429.
    body = json.dumps({"prompt": "y", "max_tokens": 8000, "ignore_eos": True, "stream": True}).encode()
    busy = []
    try:
        for i in range(5):  # one at a time: with --max-waiting 1 a burst would be refused
            busy.append(raw_request(inproc.port, "/v1/completions", body))
            inproc.wait_for(lambda m, i=i: m["stopline_requests_running"] == min(i + 1, 4)
                            and m["stopline_requests_waiting"] == max(0, i - 3))
        r = httpx.post(inproc.base + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
    finally:
        for s in busy:
            s.close()
    inproc.wait_idle(timeout=1.0)


def test_a_client_gone_before_its_body_arrived_is_not_an_internal_error(inproc):
    """Found by the marathon (bench/marathon.py): a client that drops its connection while the
    server still reads its body was a 500 with a traceback in the log. It is a quiet 499 now,
    nothing admitted, and the server serves on."""
    import socket

    before = inproc.output().count("Traceback")
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", inproc.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)  # the handler is waiting for the rest of the body
        s.close()
    r = httpx.post(inproc.base + "/v1/completions", json={"prompt": "z", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    out = inproc.output()
    assert out.count("Traceback") == before and "internal error" not in out, out[-3000:]
    assert inproc.metrics()["stopline_requests_open"] == 0


def test_sigterm_drains_then_ends_the_rest_with_a_shutdown_error(inproc):
    short: list = []
    long: list = []
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_stream_lines, args=(inproc.base, {
            "prompt": "b", "max_tokens": 8000, "ignore_eos": True, "stream": True}, long, started[0])),
        threading.Thread(target=_stream_lines, args=(inproc.base, {
            "prompt": "a", "max_tokens": 30, "ignore_eos": True, "stream": True}, short, started[1])),
    ]
    for t, e in zip(threads, started, strict=True):  # one by one: --max-waiting 1
        t.start()
        assert e.wait(10)
    inproc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    # Draining: not admitting, and not healthy.
    assert httpx.get(inproc.base + "/health").status_code == 503
    refused = httpx.post(inproc.base + "/v1/completions", json={"prompt": "c", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    for t in threads:
        t.join(15)
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]"
    # Ended by the engine, not by its client: an error event naming the reason (issue 46),
    # not finish_reason "abort" + [DONE] that a client would count as a success.
    final = long[-2]["error"]
    assert final["code"] == "engine_shutdown" and final["type"] == "service_unavailable_error", final
    assert all("choices" in c and c["choices"][0]["finish_reason"] is None for c in long[:-2])
    assert inproc.proc.wait(15) == 0
