"""CPU a streamed chunk costs the bench client: the `openai` client's typed stream against the
line-by-line read stopline/bench/client.py uses, over a canned stream of 4,096 chunks (no
network, no server: only what the client itself spends).

    python bench/client_cost.py
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from openai import AsyncOpenAI

from stopline.bench.client import BenchClient, complete

N = 4096
CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " token", "finish_reason": None, "logprobs": None}]}
BODY = ("".join(f"data: {json.dumps(CHUNK)}\n\n" for _ in range(N)) + "data: [DONE]\n\n").encode()


def reply(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=BODY)


def transport() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(reply))


async def line_by_line() -> None:
    out = await complete(BenchClient("http://bench.test", transport()), "m", "p", N)
    assert out.chunks == N, out.error


async def typed() -> None:
    client = AsyncOpenAI(base_url="http://bench.test/v1", api_key="k", http_client=transport())
    stream = await client.completions.create(model="m", prompt="p", max_tokens=N, stream=True)
    chunks = 0
    async for chunk in stream:
        chunks += sum(1 for choice in chunk.choices if choice.text)
    assert chunks == N


def main() -> None:
    for name, read in (("line by line", line_by_line), ("openai typed", typed)) * 3:
        t = time.process_time()
        asyncio.run(read())
        print(f"{name}: {(time.process_time() - t) / N * 1e6:.1f} us CPU a chunk")


if __name__ == "__main__":
    main()
