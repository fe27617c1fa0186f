"""Helpers shared by the tests/test_engine_*.py files.

- `sharp_tiny_dir`: a tiny random Llama whose logits are spread enough that greedy decoding
  has clear winners (see SHARP_INIT_STD), so an oracle match means something.
- `hf_greedy`: HF transformers' greedy continuation of token-id prompts, with the top-1/top-2
  logit gap at every step (the margin that numerical noise would have to beat).
- `drive`: run an EngineCore to completion, auditing the block ledger after every step.
- `record_plans`: keep the scheduler's step plans, to prove that a scenario (chunking,
  preemption, mixed steps) really happened rather than assuming it did.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from stopline.engine.core import EngineCore
from stopline.engine.output import RequestOutput
from stopline.request import FinishReason, SamplingParams, TokenLogprob, Usage
from stopline.sched.plan import StepPlan
from tests.tiny_model import make_tiny_llama_dir

# At the default init_std=0.02 the tiny model's logits have std ~0.17 and the top-1/top-2 gap
# falls to ~1e-5 on some steps, where float rounding (which differs between any two correct
# implementations) can flip greedy. At 0.2 the logits have std ~1.6, the smallest gap over 16
# prompts x 48 steps is ~1.5e-3 (1000x the fp32 noise) and the outputs don't loop.
SHARP_INIT_STD = 0.2
# Smallest top-1/top-2 logit gap an oracle comparison accepts: differences between two correct
# fp32 implementations are ~1e-6 (tiny) to ~1e-4 (SmolLM2, 30 layers).
MIN_MARGIN_TINY = 1e-4
MIN_MARGIN_SMOLLM2 = 1e-3

VOCAB_TINY = 512
FIRST_PLAIN_ID = 3  # ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|> (EOS)


def sharp_tiny_dir(factory: pytest.TempPathFactory) -> Path:
    """The sharp tiny model, built once per session (every module asks for the same dir)."""
    path = factory.getbasetemp() / "sharp_tiny_llama"
    if not (path / "tokenizer_config.json").is_file():
        make_tiny_llama_dir(path, seed=0, init_std=SHARP_INIT_STD)
    return path


def random_prompts(n: int, lengths: Sequence[int], seed: int, vocab: int = VOCAB_TINY) -> list[list[int]]:
    """n prompts of plain (non-special) token ids, lengths cycling through `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


@dataclass
class Reference:
    tokens: list[list[int]]
    margins: list[float]  # per prompt: the smallest top-1/top-2 logit gap over its steps

    def check_meaningful(self, min_margin: float) -> None:
        """Fail (not skip) if a near-tie makes the greedy reference a coin flip."""
        worst = min(self.margins)
        assert worst > min_margin, (
            f"greedy reference has a near-tie (top-1/top-2 gap {worst:.2e} <= {min_margin:.0e}); "
            "an exact-match test on it would be luck, pick other prompts or a sharper model")


def load_hf(model_dir: Path):  # -> transformers.PreTrainedModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # Generate exactly max_new_tokens like the engine with ignore_eos=True.
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def hf_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, batch_size: int = 16,
              pad_id: int = 0, **generate_kwargs: object) -> Reference:
    """HF `generate` greedy continuations, batched with left padding (HF's own recipe for
    batched decoder-only generation), plus the logit margin of every step. Prompts are grouped
    by length (less padding to compute) and repeats are computed once."""
    unique = sorted({tuple(p) for p in prompts}, key=len)
    done: dict[tuple[int, ...], tuple[list[int], float]] = {}
    for s in range(0, len(unique), batch_size):
        group = [list(p) for p in unique[s:s + batch_size]]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, output_scores=True,
                             return_dict_in_generate=True, **generate_kwargs)
        # Scores are the logits after HF's logits processors: the ones argmax chose from.
        scores = torch.stack(out.scores, dim=1)  # [batch, steps, vocab]
        top2 = scores.topk(2, dim=-1).values
        gap = (top2[..., 0] - top2[..., 1]).min(dim=1).values
        for p, toks, g in zip(group, out.sequences[:, width:].tolist(), gap.tolist(), strict=True):
            done[tuple(p)] = (toks, g)
    return Reference([done[tuple(p)][0] for p in prompts], [done[tuple(p)][1] for p in prompts])


@torch.inference_mode()
def hf_log_softmax(model, token_ids: Sequence[int]) -> torch.Tensor:
    """log_softmax of HF's next-token logits at every position of `token_ids` (float64)."""
    logits = model(torch.tensor([list(token_ids)])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@dataclass
class Result:
    """What a client received for one sample, assembled from the engine's deltas."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_detail: str | None = None
    usage: Usage | None = None
    deltas: list[RequestOutput] = field(default_factory=list)


def collect(results: dict[tuple[str, int], Result], outs: Sequence[RequestOutput]) -> None:
    for o in outs:
        r = results.setdefault((o.request_id, o.index), Result())
        assert r.finish_reason is None, f"{o.request_id}/{o.index}: output after its terminal one"
        r.token_ids += o.new_token_ids
        r.text += o.new_text
        r.logprobs += o.new_logprobs
        r.deltas.append(o)
        if o.finished:
            r.finish_reason, r.stop_detail, r.usage = o.finish_reason, o.stop_detail, o.usage


def drive(engine: EngineCore, requests: Sequence[tuple[str, Sequence[int], SamplingParams]] = (), *,
          audit: bool = True, max_steps: int = 10_000,
          before_step: Callable[[EngineCore, int], None] | None = None,
          after_step: Callable[[EngineCore, int], None] | None = None,
          ) -> dict[tuple[str, int], Result]:
    """Add `requests`, step until the engine is idle (auditing after every step), and check that
    the idle engine holds nothing: no family, no owned block, no fenced block, no queued request.

    Returns results keyed by (request id, sample index)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    results: dict[tuple[str, int], Result] = {}
    step = 0
    while engine.has_unfinished() or step == 0:
        assert step < max_steps, f"engine still busy after {max_steps} steps"
        if before_step is not None:
            before_step(engine, step)
        collect(results, engine.step())
        if audit:
            engine.audit()
        if after_step is not None:
            after_step(engine, step)
        step += 1
    assert_idle(engine)
    return results


def greedy_logprobs(eng: EngineCore, prompts: Sequence[Sequence[int]]) -> dict:
    """Each prompt's 12 greedy tokens and top-2 logprobs (request id -> (tokens, logprobs)),
    run to the end on `eng`, then audited."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    out: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            lps += [(lp.logprob, lp.top) for lp in o.new_logprobs]
    eng.audit()
    return out


def assert_idle(engine: EngineCore) -> None:
    engine.audit()
    assert not engine.families, f"finished engine still tracks {list(engine.families)}"
    assert engine.kv_manager.num_used == 0, f"{engine.kv_manager.num_used} blocks still owned"
    assert not engine.kv_manager.deferred, "blocks still wait behind the fence"
    assert not engine.queues.running and not engine.queues.waiting


def record_plans(engine: EngineCore) -> list[list[tuple[str, int, int, bool]]]:
    """Wrap the scheduler so that every step's plan is kept as
    [(request id, first position, tokens, samples)]. Returns the (growing) list."""
    plans: list[list[tuple[str, int, int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recording() -> StepPlan:
        plan = schedule()
        plans.append([(c.req.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks])
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    """Greedy sampling that always runs max_tokens steps (the oracle generates that many)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def signature(completion) -> list[tuple]:
    """A completion's tokens with their logprobs and top alternatives: what batch invariance
    compares, bit for bit."""
    return [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in completion.logprobs]


def signatures_alone(llm, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[tuple]]:
    """Each prompt's greedy signature (3 top logprobs a token), run through llm by itself."""
    return [signature(llm.generate([p], greedy(max_new, logprobs=3))[0].outputs[0]) for p in prompts]


def assert_batch_invariant(llm, prompts: Sequence[Sequence[int]], alone: list[list[tuple]], max_new: int, *,
                           preempted: bool, batched: bool = True) -> None:
    """All the prompts through llm at once give each the signature it had alone, bit for bit.
    batched: some step really ran more than one request; preempted: the pool ran short (the
    engine preempted at least once)."""
    plans = record_plans(llm.engine)
    res = llm.generate(prompts, greedy(max_new, logprobs=3))
    if batched:
        assert max(len(p) for p in plans) > 1
    if preempted:
        assert sum(llm.engine.lifecycle.stats.preemptions.values()) > 0, "the pool was never short"
    differ = [i for i, r in enumerate(res) if signature(r.outputs[0]) != alone[i]]
    assert differ == [], f"{len(differ)} of {len(prompts)} requests changed when batched: {differ}"
