"""Turn a step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

A seeded request draws its k-th token from a generator seeded by (seed, k), not from a
stream shared with other requests, so its output is the same whatever else runs beside it
and after a preemption (which replays nothing of the generator).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from stopline.grammar import bitmask
from stopline.model.kernels.native import try_kernels
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
    # Tokens taken as already output before this row: a verify row's drafts before it (row j
    # is sampled as plain decoding would, had the first j drafts been drawn).
    prior: Sequence[int] = ()

    def history(self) -> list[int]:
        """The output tokens this row is sampled after."""
        return self.req.output_token_ids + list(self.prior) if self.prior else self.req.output_token_ids


@dataclass
class Sampled:
    token_id: int
    logprob: TokenLogprob | None


def apply_penalties(logits: torch.Tensor, req: Request, output: Sequence[int] | None = None) -> torch.Tensor:
    """output: the tokens sampled so far (default: req's)."""
    p = req.params
    vocab = logits.shape[0]
    output = req.output_token_ids if output is None else list(output)
    out = torch.tensor(output, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(req.prompt_token_ids + output, dtype=torch.long))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if out.numel() and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(row: torch.Tensor, bias: Mapping[int, float]) -> None:
    """Add each bias to its token's logit (in place, on the task's own row copy)."""
    ids = torch.tensor(list(bias), dtype=torch.long)
    row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype)


def suppressed_ids(req: Request, eos_token_ids: Collection[int], vocab: int, ahead: int = 0) -> list[int]:
    """Tokens the request may not sample yet: below min_tokens, EOS (unless ignore_eos) and its
    stop tokens. Masking them, as vLLM and HF do, keeps an early EOS out of the output rather
    than emitting it and carrying on past it. ahead: tokens drawn beyond req's output."""
    p = req.params
    if len(req.output_token_ids) + ahead >= p.min_tokens:
        return []
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return sorted(t for t in ids if 0 <= t < vocab)


def _filtered(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """logits with the tokens top-k / min-p / top-p drop set to -inf (the rest unchanged:
    the draw applies the temperature)."""
    p = req.params
    keep = torch.ones_like(logits, dtype=torch.bool)
    scaled = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[0]:
        keep &= scaled >= torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled.double(), dim=-1)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
        probs = probs.masked_fill(~keep, 0.0)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=0)
        drop = (cum - sp) > p.top_p * cum[-1]  # keep the smallest set reaching top_p
        keep[idx[drop]] = False
    return logits.masked_fill(~keep, float("-inf"))


def draw_keys(req: Request, ahead: int = 0) -> tuple[int, int]:
    """The 64-bit key of req's next random draw (ahead: tokens drawn beyond its output), as
    two 32-bit halves."""
    z = mix_seed(req.seed, len(req.output_token_ids) + ahead)
    return z & 0xFFFFFFFF, z >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2^32 without overflowing int64: two 16-bit halves of c.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _triple32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def race_torch(rows: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The draw of csrc/sample.c in torch ([R, V] float32 rows, [R] inverse temperatures,
    [R, 2] int64 keys): for devices or machines without the C kernels."""
    v = torch.arange(rows.shape[1], dtype=torch.int64, device=rows.device)
    h = _triple32(_triple32(v ^ keys[:, :1]) ^ keys[:, 1:])
    u = ((h >> 9) * 2 + 1).to(torch.float32) * 2.0 ** -24
    w = torch.exp((rows - rows.amax(dim=1, keepdim=True)) * inv_temp[:, None])
    return torch.argmax(w / -torch.log(u), dim=1)


def draw_rows(logits: torch.Tensor, rows: list[int], inv_temp: list[float],
              keys: list[tuple[int, int]]) -> list[int]:
    """One token from each chosen row of logits ([N, vocab]) by the exponential race of
    csrc/sample.c: the token depends only on the row, its temperature and its key."""
    lib = try_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.stride(1) != 1:
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return race_torch(logits.index_select(0, idx).float(),
                          torch.tensor(inv_temp, dtype=torch.float32, device=logits.device),
                          torch.tensor(keys, dtype=torch.int64, device=logits.device)).tolist()
    if min(rows) < 0 or max(rows) >= logits.shape[0]:
        raise IndexError(f"rows {min(rows)}..{max(rows)} of {logits.shape[0]} logit rows")
    idx = torch.tensor(rows, dtype=torch.long)
    t = torch.tensor(inv_temp, dtype=torch.float32)
    k = torch.tensor(keys, dtype=torch.int64).to(torch.int32)  # the low 32 bits, as uint32
    out = torch.empty(len(rows), dtype=torch.long)
    lib.stopline_sample_rows(logits.data_ptr(), logits.stride(0), idx.data_ptr(), t.data_ptr(),
                             k.data_ptr(), len(rows), logits.shape[1], out.data_ptr())
    return out.tolist()


def _logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(logits.double(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(ids, vals, strict=True)]
    return TokenLogprob(token, float(lp[token]), top)


def score_tokens(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Row i of logits ([N, vocab]) scores tokens[i]: its log-probability and the top-k
    alternatives (prompt logprobs). In float64, like the sampled tokens' logprobs."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if k:
        vals, ids = torch.topk(lp, k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return [TokenLogprob(t, p, top) for t, p, top in zip(tokens, picked, tops, strict=True)]


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


def nonfinite_rows(logits: torch.Tensor) -> set[int]:
    """Rows of logits ([N, vocab]) no token can be drawn from: a NaN or +inf anywhere, or
    nothing above -inf. In C on CPU where it is built (one pass over the rows in place);
    torch's amax propagates NaN the same way."""
    if not logits.numel():
        return set()
    lib = try_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1:
        finite = torch.isfinite(logits.amax(dim=-1)).tolist()
        return {i for i, ok in enumerate(finite) if not ok}
    ok = torch.empty(logits.shape[0], dtype=torch.uint8)
    lib.stopline_rows_ok(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], ok.data_ptr())
    return {i for i, v in enumerate(ok.tolist()) if not v}


def sample(logits: torch.Tensor, tasks: Sequence[SampleTask],
           eos_token_ids: Collection[int] = (),
           grammar_masks: Mapping[int, torch.Tensor] | None = None) -> list[Sampled]:
    """One token per task. Greedy rows without penalties or masks are done in one argmax,
    random rows whose logits need no change in one draw over the rows in place.
    grammar_masks: task index -> its packed grammar mask (stopline.grammar.bitmask), applied
    to that task's own copy of its row, so no row's token depends on another's mask."""
    vocab = logits.shape[-1]
    grammar_masks = grammar_masks or {}
    edited: dict[int, torch.Tensor] = {}  # task -> its row after penalties and masks (a copy)
    # Every grammar row masked at once (one unpack, one fill over their copies). Masking
    # first is exact: the penalties and suppressions below keep -inf at -inf.
    gidx = [i for i in range(len(tasks)) if i in grammar_masks]
    masked: dict[int, torch.Tensor] = {}  # views of `block`, the grammar rows' masked copies
    if gidx:
        block = bitmask.apply_rows(logits, [tasks[i].row for i in gidx],
                                   torch.stack([grammar_masks[i] for i in gidx]))
        masked = {i: block[j] for j, i in enumerate(gidx)}
    for i, t in enumerate(tasks):
        p = t.req.params
        mask = suppressed_ids(t.req, eos_token_ids, vocab, len(t.prior))
        filters = not p.greedy and (p.top_k or p.min_p > 0 or p.top_p < 1.0)
        if p.needs_penalties or p.logit_bias or mask or filters or i in masked:
            # this task's own copy (grammar rows come masked already): no other row sees its edits
            row = masked[i] if i in masked else logits[t.row].clone()
            if p.needs_penalties:
                row = apply_penalties(row, t.req, t.history())
            if p.logit_bias:
                apply_logit_bias(row, p.logit_bias)  # a masked token stays at -inf
            if mask:
                row[mask] = float("-inf")
            edited[i] = row
    tokens: dict[int, int] = {}  # task -> its token
    plain = [i for i in range(len(tasks)) if i not in edited]
    argmax = [i for i in plain if tasks[i].req.params.greedy]
    if argmax:
        tokens.update(zip(argmax, argmax_rows(logits, [tasks[i].row for i in argmax]), strict=True))
    drawn = [i for i in plain if not tasks[i].req.params.greedy]
    if drawn:
        tokens.update(zip(drawn, _draw(logits, [tasks[i].row for i in drawn], [tasks[i] for i in drawn]),
                          strict=True))
    drawn = [i for i in edited if not tasks[i].req.params.greedy]
    if drawn:
        rows = torch.stack([_filtered(edited[i], tasks[i].req) for i in drawn])
        tokens.update(zip(drawn, _draw(rows, list(range(len(drawn))), [tasks[i] for i in drawn]),
                          strict=True))
    greedy = [i for i in edited if tasks[i].req.params.greedy]
    # Masked rows edited in place are still rows of `block`: one argmax call over them, not
    # one per row (32 structured greedy rows: 1.1 ms a step in per-row calls).
    in_block = [i for i in greedy if i in masked and edited[i] is masked[i]]
    if in_block:
        at = {i: j for j, i in enumerate(gidx)}  # task -> its row of block
        tokens.update(zip(in_block, argmax_rows(block, [at[i] for i in in_block]), strict=True))
    for i in greedy:
        if i not in tokens:
            tokens[i] = int(torch.argmax(edited[i]))
    return [Sampled(tokens[i], None if t.req.params.logprobs is None else
                    _logprob(edited.get(i, logits[t.row]), tokens[i], t.req.params.logprobs))
            for i, t in enumerate(tasks)]


def _draw(logits: torch.Tensor, rows: list[int], tasks: list[SampleTask]) -> list[int]:
    return draw_rows(logits, rows, [1.0 / t.req.params.temperature for t in tasks],
                     [draw_keys(t.req, len(t.prior)) for t in tasks])
