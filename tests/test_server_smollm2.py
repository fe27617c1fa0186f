"""End to end on the real default model: `stopline serve` with no --model serves SmolLM2."""

from __future__ import annotations

import openai
import pytest

from tests.server_harness import ServerProcess, total

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(smollm2_gguf, stopline_cache_dir):
    srv = ServerProcess("--kv-cache-gb", "0.25", env={"STOPLINE_CACHE_DIR": str(stopline_cache_dir)})
    try:
        srv.wait_ready(timeout=240)
        yield srv
    finally:
        srv.stop()


def test_smollm2_answers_and_a_closed_stream_frees_everything(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")

    before = server.metrics()
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=400, stream=True,
        messages=[{"role": "user", "content": "Write a long story about a robot."}],
        extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle(before["stopline_kv_blocks_used"])
    after = server.metrics()
    assert total(after, 'stopline_aborts_total{source="disconnect"') == \
        total(before, 'stopline_aborts_total{source="disconnect"') + 1
