"""The stream's terminal output after a client's cancel (stopline/engine/streams.py), without
a model: what the consumer reads when the cancel lost the race to the request's own end."""

from __future__ import annotations

import asyncio
import time

from stopline.engine.output import RequestOutput
from stopline.engine.streams import RequestStream
from stopline.request import AbortSource, FinishReason, TokenLogprob, Usage

SCORES = [TokenLogprob(5, -1.5, [(5, -1.5)]), TokenLogprob(9, -0.25, [(9, -0.25)])]


def _read(outs: list[RequestOutput]) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r", 1, 3, time.monotonic())
        stream.cancel(AbortSource.CANCEL)  # the client's cancel, before the engine's end arrives
        for o in outs:
            stream.push(o)
        return [o async for o in stream]

    return asyncio.run(run())


def test_an_end_that_stands_keeps_its_prompt_scores():
    """max_tokens 0 with prompt logprobs: the engine scored the prompt and ended `length`
    before the cancel reached it. Nothing was withheld, so the end stands as complete, and
    the prompt's scores it carries reach the consumer (they were dropped: a complete answer
    without the scores it was asked for)."""
    [out] = _read([RequestOutput("r", 0, "r", finished=True, finish_reason=FinishReason.LENGTH,
                                 stop_detail="max_tokens", usage=Usage(3, 0), prompt_logprobs=SCORES)])
    assert out.finish_reason is FinishReason.LENGTH
    assert out.prompt_logprobs == SCORES


def test_a_cut_end_delivers_nothing_more():
    """Tokens computed after the cancel are withheld: the end reads `abort`, and nothing of
    that terminal output (tokens, text, prompt scores) reaches the consumer."""
    [out] = _read([RequestOutput("r", 0, "r", new_token_ids=[7, 8], new_text="ab", finished=True,
                                 finish_reason=FinishReason.LENGTH, stop_detail="max_tokens",
                                 usage=Usage(3, 2), prompt_logprobs=SCORES)])
    assert out.finish_reason is FinishReason.ABORT
    assert out.prompt_logprobs is None and not out.new_token_ids and not out.new_text
    assert out.usage.undelivered_tokens == 2
