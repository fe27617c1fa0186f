"""Turn a step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

A seeded request draws its k-th token from a generator seeded by (seed, k), not from a
stream shared with other requests, so its output is the same whatever else runs beside it
and after a preemption (which replays nothing of the generator).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from stopline.model.native import try_kernels
from stopline.request import Request, TokenLogprob

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit seed per drawn token."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleTask:
    row: int  # row of the logits tensor
    req: Request  # who receives the token


@dataclass
class Sampled:
    token_id: int
    logprob: TokenLogprob | None


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    vocab = logits.shape[0]
    out = torch.tensor(req.output_token_ids, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(req.prompt_token_ids + req.output_token_ids, dtype=torch.long))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if out.numel() and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def suppressed_ids(req: Request, eos_token_ids: Collection[int], vocab: int) -> list[int]:
    """Tokens the request may not sample yet: below min_tokens, EOS (unless ignore_eos) and its
    stop tokens. Masking them, as vLLM and HF do, keeps an early EOS out of the output rather
    than emitting it and carrying on past it."""
    p = req.params
    if len(req.output_token_ids) >= p.min_tokens:
        return []
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return sorted(t for t in ids if 0 <= t < vocab)


def _filtered(logits: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.double(), dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=0)
        drop = (cum - sp) > p.top_p * cum[-1]  # keep the smallest set reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sp)
    return probs


def _logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(logits.double(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(ids, vals, strict=True)]
    return TokenLogprob(token, float(lp[token]), top)


def argmax_rows(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """torch.argmax of each chosen row of logits ([N, vocab]); in C on CPU where it is built
    (reads the rows in place: 11 rows of 49,152 in 131 us against 782 for index_select and
    torch.argmax here)."""
    idx = torch.tensor(rows, dtype=torch.long)
    lib = try_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.stride(1) != 1 or not rows:
        return torch.argmax(logits.index_select(0, idx.to(logits.device)), dim=-1).tolist()
    if min(rows) < 0 or max(rows) >= logits.shape[0]:
        raise IndexError(f"rows {min(rows)}..{max(rows)} of {logits.shape[0]} logit rows")
    out = torch.empty(len(rows), dtype=torch.long)
    lib.stopline_row_argmax(logits.data_ptr(), logits.stride(0), idx.data_ptr(), len(rows), logits.shape[1],
                            out.data_ptr())
    return out.tolist()


def sample(logits: torch.Tensor, tasks: Sequence[SampleTask],
           eos_token_ids: Collection[int] = ()) -> list[Sampled]:
    """One token per task. Greedy rows without penalties or masks are done in one argmax."""
    results: list[Sampled | None] = [None] * len(tasks)
    vocab = logits.shape[-1]
    masks = [suppressed_ids(t.req, eos_token_ids, vocab) for t in tasks]
    fast = [i for i, t in enumerate(tasks)
            if t.req.params.greedy and not t.req.params.needs_penalties and not masks[i]]
    if fast:
        ids = argmax_rows(logits, [tasks[i].row for i in fast])
        for i, tok in zip(fast, ids, strict=True):
            results[i] = Sampled(tok, None)
    for i, t in enumerate(tasks):
        p = t.req.params
        row = logits[t.row]
        if results[i] is None:
            row = row.clone()
            if p.needs_penalties:
                row = apply_penalties(row, t.req)
            if masks[i]:
                row[masks[i]] = float("-inf")
            if p.greedy:
                tok = int(torch.argmax(row))
            else:
                probs = _filtered(row, t.req)
                gen = torch.Generator().manual_seed(mix_seed(t.req.seed, len(t.req.output_token_ids)))
                noise = torch.empty_like(probs).exponential_(generator=gen)
                tok = int(torch.argmax(probs / noise))
            results[i] = Sampled(tok, None)
        if p.logprobs is not None:
            res = results[i]
            assert res is not None
            res.logprob = _logprob(row, res.token_id, p.logprobs)
    return [r for r in results if r is not None]
