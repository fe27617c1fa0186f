"""HF transformers `generate` behind a minimal OpenAI `/v1/completions`, as a benchmark peer.

One prompt at a time (that is how `generate` serves): a request waits for the lock, then runs
`generate` on a worker thread with a streamer feeding the HTTP response. A client that leaves
sets a flag a StoppingCriteria checks before each next token, the usual way to stop
`generate` early; a non-streaming request watches its connection for that. `/metrics`
exposes running/waiting requests and tokens generated, counted per token as they are made.

Run by start_hf.sh: python hf_server.py [--model HF_DIR] (port from $PORT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

STATS = {"running": 0, "waiting": 0, "generated": 0}
GEN_LOCK = threading.Lock()


class _Cancelled(StoppingCriteria):
    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool)


class _Streamer(BaseStreamer):
    """Hands each new token to the event loop; the first put() is the prompt."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        ids = value.reshape(-1).tolist()
        STATS["generated"] += len(ids)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ids)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def build(model_dir: str) -> FastAPI:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    app = FastAPI()

    def generate(prompt_ids: list[int], max_tokens: int, ignore_eos: bool, streamer: _Streamer,
                 flag: threading.Event) -> None:
        STATS["waiting"] += 1
        with GEN_LOCK:
            STATS["waiting"] -= 1
            STATS["running"] += 1
            try:
                if not flag.is_set():
                    model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens if ignore_eos else None, do_sample=False,
                                   streamer=streamer, stopping_criteria=[_Cancelled(flag)],
                                   pad_token_id=tok.eos_token_id)
            finally:
                STATS["running"] -= 1
                streamer.end()

    async def tokens(body: dict, flag: threading.Event):  # -> AsyncIterator[tuple[str, str | None]]
        prompt_ids = tok(body["prompt"])["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        worker = loop.run_in_executor(None, generate, prompt_ids, max_tokens,
                                      bool(body.get("ignore_eos")), _Streamer(loop, queue), flag)
        ids: list[int] = []
        text = ""
        try:
            while (new := await queue.get()) is not None:
                ids += new
                full = tok.decode(ids, skip_special_tokens=True)
                if full.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the rest
                yield full[len(text):], len(prompt_ids), len(ids)
                text = full
            yield "", len(prompt_ids), len(ids)
        finally:
            flag.set()  # the client left (or we are done): generate stops before its next token
            del worker

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            "# TYPE hf_requests_running gauge\n"
            f"hf_requests_running {STATS['running']}\n"
            "# TYPE hf_requests_waiting gauge\n"
            f"hf_requests_waiting {STATS['waiting']}\n"
            "# TYPE hf_generation_tokens counter\n"
            f"hf_generation_tokens_total {STATS['generated']}\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        flag = threading.Event()
        max_tokens = int(body.get("max_tokens") or 16)

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> bytes:
            d = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model"),
                 "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish,
                                               "logprobs": None}]}
            if usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n".encode()

        def usage(p: int, n: int) -> dict:
            return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

        if body.get("stream"):
            async def events():
                p = n = 0
                async for piece, p_, n_ in tokens(body, flag):
                    p, n = p_, n_
                    if piece:
                        yield chunk(piece, None)
                yield chunk("", "length" if n >= max_tokens else "stop")
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield chunk("", None, usage(p, n))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> tuple[str, int, int]:
            out, p, n = "", 0, 0
            async for piece, p_, n_ in tokens(body, flag):
                out, p, n = out + piece, p_, n_
            return out, p, n

        async def watch() -> None:
            # A plain handler is never told its client left: poll for it (ecosystem notes).
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            flag.set()

        job, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(watch())
        await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not job.done():
            await asyncio.wait({job})
            return Response(status_code=499)
        text, p, n = job.result()
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": body.get("model"),
                             "choices": [{"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": "length" if n >= max_tokens else "stop"}],
                             "usage": usage(p, n)})

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("HF_DIR", "/work/peers/hf-smollm2"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8103")))
    args = ap.parse_args()
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
