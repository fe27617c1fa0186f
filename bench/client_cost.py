"""CPU a streamed chunk costs the bench client: the `openai` client's typed stream against the
line-by-line read stopline/bench/client.py uses, over a canned stream of 4,096 chunks (no network).

    python bench/client_cost.py
"""

import asyncio
import json
import time

import httpx
from openai import AsyncOpenAI

from stopline.bench.client import BenchClient, complete

N = 4096
chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " token", "finish_reason": None, "logprobs": None}]}
body = "".join(f"data: {json.dumps(chunk)}\n\n" for _ in range(N)) + "data: [DONE]\n\n"
def reply(req): return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
async def raw():
    c = BenchClient("http://x", httpx.AsyncClient(transport=httpx.MockTransport(reply)))
    o = await complete(c, "m", "p", N); assert o.chunks == N, o.error
async def typed():
    c = AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=httpx.AsyncClient(transport=httpx.MockTransport(reply)))
    s = await c.completions.create(model="m", prompt="p", max_tokens=N, stream=True)
    n = 0
    async for ch in s:
        for choice in ch.choices:
            if choice.text: n += 1
    assert n == N
for name, f in (("line by line", raw), ("openai typed", typed)) * 3:
    t = time.process_time(); asyncio.run(f()); dt = time.process_time() - t
    print(f"{name}: {dt / N * 1e6:.1f} us CPU a chunk")
