"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.engine.output import RequestOutput
from stopline.request import (
    AbortSource,
    FinishReason,
    InvalidRequest,
    SamplingParams,
    TokenLogprob,
    Usage,
)


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_detail: str | None = None
    usage: Usage | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    # SamplingParams.prompt_logprobs: the score of prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def usage(self) -> Usage:
        us = [c.usage for c in self.outputs if c.usage is not None]
        return Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(u.completion_tokens for u in us),
            cached_tokens=max((u.cached_tokens for u in us), default=0),
            undelivered_tokens=sum(u.undelivered_tokens for u in us),
            draft_tokens=sum(u.draft_tokens for u in us),
            accepted_draft_tokens=sum(u.accepted_draft_tokens for u in us),
            rejected_draft_tokens=sum(u.rejected_draft_tokens for u in us),
            discarded_draft_tokens=sum(u.discarded_draft_tokens for u in us),
        )


Prompt = str | Sequence[int]


class LLM:
    """Offline batch generation on top of an in-process engine core."""

    def __init__(self, model: str | None = None, *, progress: bool = True,
                 config: EngineConfig | None = None, **engine_kwargs: object) -> None:
        if config is not None and engine_kwargs:
            raise TypeError("pass either config= or engine keyword arguments, not both")
        self.engine = EngineCore(model, config or EngineConfig(**engine_kwargs), progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[GenerationResult]:
        """Run every prompt to completion. Prompts are strings or token id lists.

        Bad input raises InvalidRequest before anything is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequest(f"{len(plist)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for i, (ids, p) in enumerate(zip(encoded, plist, strict=True)):
            if not ids:
                raise InvalidRequest(f"prompt {i}: empty prompt")
            p.validate()
        results: dict[str, GenerationResult] = {}  # by incarnation
        order = []
        try:
            for prompt, ids, p in zip(prompts, encoded, plist, strict=True):
                rid = f"gen-{next(self._ids)}"
                inc = self.engine.add_request(rid, ids, p)
                order.append(inc)
                results[inc] = GenerationResult(rid, prompt if isinstance(prompt, str) else None, ids,
                                                [Completion(i) for i in range(p.n)])
        except InvalidRequest:
            self.engine.abort(order, AbortSource.CANCEL, time.monotonic())  # nothing of a rejected batch stays queued
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        bar = tqdm(total=sum(len(r.outputs) for r in results.values()), disable=not use_tqdm,
                   desc="generating", unit="seq")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results.get(out.incarnation)
                if res is None:
                    continue
                c = res.outputs[out.index]
                c.text += out.new_text
                c.token_ids += out.new_token_ids
                c.logprobs += out.new_logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason, c.stop_detail, c.usage = out.finish_reason, out.stop_detail, out.usage
                    bar.update(1)
                if on_output is not None:
                    on_output(out)
        bar.close()
        return [results[r] for r in order]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | None = None, **kwargs: object) -> list[GenerationResult]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        results = self.generate(ids, params, **kwargs)  # type: ignore[arg-type]
        for r, p in zip(results, prompts, strict=True):
            r.prompt = p
        return results
