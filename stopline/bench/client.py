"""One benchmark request over the OpenAI HTTP API, with client-side timing and closes.

Every engine is driven the same way: `/v1/completions`, greedy unless a temperature is given,
EOS ignored unless asked (each engine accepts `ignore_eos` as an extra body field). A request
can be closed by the client after some tokens or some seconds; closing drops the HTTP
connection, which is what a user's disconnect looks like to a server.

Non-streamed requests go through the official async `openai` client. Streams are read from
its httpx client line by line, as vLLM's serving benchmark reads them: the client runs on the
cores the engine runs on, and the `openai` client's typed chunks cost 118-178 us of CPU each
against 6-9 us read this way (`python bench/client_cost.py`), a tenth of a core at 750 tok/s.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from openai import AsyncOpenAI


@dataclass
class Outcome:
    """What the client saw of one request (times: time.perf_counter())."""

    sent: float
    end: float = 0.0
    first: float | None = None  # first non-empty text chunk
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    chunks: int = 0  # non-empty text chunks received (≈ tokens for token-by-token streams)
    completion_tokens: int | None = None  # from usage, when the server sent it
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    closed: bool = False  # the client closed it on purpose
    closed_at: float | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        """Tokens received: the server's usage count when it sent one, else the chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def latency(self) -> float:
        return self.end - self.sent

    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_json(self, t0: float = 0.0) -> dict[str, Any]:
        """Compact form for the results file: times relative to t0, no per-chunk times."""
        d = asdict(self)
        d.pop("chunk_times")
        for k in ("sent", "end", "first", "closed_at"):
            if d[k] is not None:
                d[k] = round(d[k] - t0, 6)
        d["text"] = d["text"][:2000]
        return d


class BenchClient(AsyncOpenAI):
    """The `openai` client, and the httpx client under it that streams are read from."""

    def __init__(self, base_url: str, http: httpx.AsyncClient) -> None:
        super().__init__(base_url=base_url.rstrip("/") + "/v1", api_key="bench", max_retries=0,
                         http_client=http)
        self.http = http


class StreamError(Exception):
    """An HTTP error status, or an error event in the stream, as the server sent it."""


def make_client(base_url: str, timeout: float = 600.0) -> BenchClient:
    """One client per engine: no retries (a retry would hide a failure), no keep-alive cap."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
                             timeout=httpx.Timeout(timeout, connect=10.0))
    return BenchClient(base_url, http)


async def complete(client: BenchClient, model: str, prompt: str, max_tokens: int, *,
                   stream: bool = True, ignore_eos: bool = True,
                   close_after_tokens: int | None = None,
                   close_after_s: float | None = None, temperature: float = 0.0,
                   seed: int | None = None) -> Outcome:
    """Send one completion (greedy unless a temperature is given) and record what arrives.

    close_after_tokens: close the stream once that many text chunks arrived.
    close_after_s: drop the connection that many seconds after sending, wherever it is.
    """
    out = Outcome(sent=time.perf_counter())
    body: dict[str, Any] = {"ignore_eos": ignore_eos, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    task = asyncio.ensure_future(_run(client, model, prompt, max_tokens, stream, body,
                                      close_after_tokens, out))
    try:
        if close_after_s is None:
            await task
        else:
            done, _ = await asyncio.wait({task}, timeout=close_after_s)
            if not done:
                # Cancelling the task makes httpx close the connection: the server sees a
                # disconnect, whether the response had started or not.
                out.closed, out.closed_at = True, time.perf_counter()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            else:
                task.result()
    except Exception as exc:  # an engine's failure is a result, not a crash of the bench
        out.error = f"{type(exc).__name__}: {exc}"[:500]
    out.end = time.perf_counter()
    return out


async def _run(client: BenchClient, model: str, prompt: str, max_tokens: int, stream: bool,
               body: dict[str, Any], close_after_tokens: int | None, out: Outcome) -> None:
    if not stream:
        resp = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                               stream=False, extra_body=body)
        out.first = out.end = time.perf_counter()
        choice = resp.choices[0]
        out.text, out.finish_reason = choice.text, choice.finish_reason
        if resp.usage is not None:
            out.completion_tokens = resp.usage.completion_tokens
            out.prompt_tokens = resp.usage.prompt_tokens
        return
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    url = f"{client.base_url}completions"
    async with client.http.stream("POST", url, json=payload,
                                  headers={"Authorization": f"Bearer {client.api_key}"}) as r:
        if r.status_code >= 400:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(f"error event: {json.dumps(chunk['error'])[:300]}")
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"].get("completion_tokens")
                out.prompt_tokens = chunk["usage"].get("prompt_tokens")
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    if out.first is None:
                        out.first = now
                    out.chunk_times.append(now)
                    out.text += choice["text"]
                    out.chunks += 1
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
            if close_after_tokens is not None and out.chunks >= close_after_tokens \
                    and out.finish_reason is None:
                out.closed, out.closed_at = True, time.perf_counter()
                break
