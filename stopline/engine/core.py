"""The engine core: admit, schedule, run, sample, stop — one step at a time.

Threading: `add_request` and `abort` may be called from any thread; they only record the
wish. Everything else runs on the thread that calls `step()`, which applies aborts before
adds at every step boundary (and again right after the forward pass, so a token computed
for a request whose abort arrived mid-step is never delivered). If every request of the
step in flight is aborted, the forward stops at the next layer boundary.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from stopline.config import EngineConfig, PreemptionMode
from stopline.engine.output import OutputProcessor, RequestOutput, Stop
from stopline.kv.block_pool import BlockPool, LedgerError
from stopline.kv.kv_cache import KVCache, SwapSpace
from stopline.lifecycle import Lifecycle
from stopline.model.decoder_native import StepInterrupt
from stopline.model.llama import LlamaModel, StepInterrupted
from stopline.model.loaders.loader import LoadedModel, load_model
from stopline.request import (
    AbortSource,
    Family,
    FinishReason,
    InvalidRequest,
    Request,
    RequestStatus,
    SamplingParams,
)
from stopline.sched.plan import StepPlan
from stopline.sched.scheduler import Scheduler
from stopline.worker.runner import ModelRunner, StepResult
from stopline.worker.sampler import Sampled, SampleTask, sample

log = logging.getLogger("stopline.engine")


class EngineCore:
    def __init__(self, model: LoadedModel | str | None = None, config: EngineConfig | None = None,
                 *, progress: bool = True) -> None:
        self.config = config or EngineConfig()
        # Denormal activations make CPU matmuls several times slower; they carry no signal.
        torch.set_flush_denormal(True)
        loaded = model if isinstance(model, LoadedModel) else load_model(model, progress=progress)
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        cfg = self.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        num_blocks = cfg.num_blocks or max(1, int(cfg.kv_cache_memory_gb * 2**30) // per_block)
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.kv = KVCache(mc.num_layers, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                          device=cfg.device)
        if cfg.debug:
            self.pool.on_garbage = self.kv.poison
        swap = None
        if cfg.preemption_mode is not PreemptionMode.RECOMPUTE:
            swap = SwapSpace(cfg.swap_space_blocks or num_blocks)
        self.model = LlamaModel(mc, loaded.weights, max_rows=cfg.max_num_batched_tokens,
                                max_logit_rows=cfg.max_num_seqs, device=cfg.device,
                                linear_backend=cfg.linear_backend, blocks=loaded.blocks,
                                quant_max_rows=cfg.quant_max_rows, attention=cfg.attention_backend)
        self.model.calibrate()
        if self.model.attention == "torch":
            # Torch attention multiplies whole blocks by masked weights: unwritten slots must
            # hold zeros, not a freed block's NaN. The C kernel reads written slots only.
            self.pool.on_allocate = self.kv.zero
        self.runner = ModelRunner(self.model, self.kv, cfg)
        self.scheduler = Scheduler(cfg, self.pool, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.lifecycle = Lifecycle(cfg, self.pool, self.scheduler, self.kv, swap, self._on_terminal)
        self.scheduler.lifecycle = self.lifecycle
        if cfg.preemption_mode is PreemptionMode.AUTO:
            self.lifecycle.calibrate_swap()
        self.families: dict[str, Family] = {}  # live requests by the caller's id
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()
        self._inbox_adds: list[Family] = []
        self._inbox_aborts: list[tuple[str, AbortSource]] = []
        self._to_schedule: list[Family] = []
        self._inflight: StepPlan | None = None
        self._inflight_ids: set[str] = set()
        self._aborting: set[str] = set()
        self._interrupt = StepInterrupt()  # an Event the C decoder loop can read too
        self.steps = 0
        self.interrupted_steps = 0
        self._ms_per_prefill_token: float | None = None
        # Async scheduling: the forward (and the sampling after it) runs on a worker thread
        # (torch releases the GIL) while this thread detokenizes and emits the previous
        # step's tokens.
        self._worker = ThreadPoolExecutor(1, "stopline-forward") if cfg.async_scheduling else None
        self._text_pending: list[Request] = []
        # Where outputs go as soon as they are ready (the async engine sets it); otherwise
        # step() returns them.
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None

    # ---- entry points (any thread) ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams | None = None, arrival: float | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequest (nothing is queued) if it can't
        be served: empty or over-long prompt, bad parameters, an id already in use."""
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequest("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt: token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"prompt: {len(prompt)} tokens; the model's context is "
                                 f"{self.max_model_len} tokens (prompt plus at least one new token)")
        need = -(-(len(prompt) + 1) // self.pool.block_size) + (params.n - 1)
        if need > self.pool.num_blocks:
            raise InvalidRequest(f"prompt: needs {need} KV blocks; the pool has {self.pool.num_blocks}")
        arrival = time.monotonic() if arrival is None else arrival
        members = [Request(request_id, prompt, params, arrival=arrival, index=i) for i in range(params.n)]
        family = Family(request_id, members)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        for i, m in enumerate(members):
            m.family = family
            m.seed = base_seed + i
        leader = members[0]
        for m in members[1:]:
            m.fork_leader = leader
        leader.forks_pending = members[1:]
        with self._lock:
            if request_id in self.families or any(f.request_id == request_id for f in self._inbox_adds):
                raise InvalidRequest(f"request id {request_id!r} is already in use")
            self._inbox_adds.append(family)

    def abort(self, request_ids: str | Iterable[str], source: AbortSource = AbortSource.CANCEL) -> None:
        """Ask for requests to end with finish_reason 'abort'. Unknown or finished ids are
        ignored; asking twice is the same as once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            for rid in ids:
                self._inbox_aborts.append((rid, source))
                self._aborting.add(rid)
            if self._inflight_ids and self._inflight_ids <= self._aborting:
                self._interrupt.set()

    # ---- the step -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._lock:
            return (bool(self.families) or bool(self._inbox_adds) or bool(self._inbox_aborts)
                    or bool(self._text_pending))

    def step(self) -> list[RequestOutput]:
        self._apply_inbox()
        self._check_deadlines()
        if self._ms_per_prefill_token and self.config.target_step_ms:
            self.scheduler.prefill_cap = max(self.config.block_size,
                                             int(self.config.target_step_ms / self._ms_per_prefill_token))
        plan = self.scheduler.schedule()
        if plan.chunks:
            self._run(plan)
        else:
            self._text_phase()
        if not self.families and self.runner.rows is not None:
            self.runner.rows.reset()  # an idle engine keeps no copies of K/V
        if self.config.debug:
            self.audit()
        self.steps += 1
        return self.outputs.collect()

    def _run(self, plan: StepPlan) -> None:
        with self._lock:
            self._inflight = plan
            self._inflight_ids = {c.req.request_id for c in plan.chunks}
            self._interrupt.clear()
            if self._inflight_ids <= self._aborting:
                self._interrupt.set()
        t0 = time.perf_counter()
        result: StepResult | None = None
        sampled: dict[tuple[int, int], Sampled] | None = None
        try:
            if self._worker is not None:
                # Overlap: the text phase of the previous step runs while this forward does.
                future = self._worker.submit(self._forward_and_sample, plan)
                self._text_phase()
                result, sampled = future.result()
            else:
                result = self.runner.execute(plan, self._interrupt)
        except StepInterrupted:
            self.interrupted_steps += 1
        except Exception as exc:  # engine-wide: every request ends with an error, none hangs
            log.exception("step %d failed", plan.step_id)
            self._apply_inbox(adds=False)
            for fam in list(self.families.values()):
                for r in fam.live():
                    self.lifecycle.fail(r, FinishReason.ERROR, f"engine step failed: {exc!r}")
        finally:
            with self._lock:
                self._inflight = None
                self._inflight_ids = set()
        elapsed_ms = (time.perf_counter() - t0) * 1000
        n_prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
        # Cost per row of the step, decode rows included: the cap gives the prefill rows about
        # target_step_ms on top of the decodes. Measured from 16 prefill rows up, or from the
        # cap itself: a threshold above the cap would freeze the estimate once one slow step
        # had pushed the cap below it.
        if n_prefill >= min(16, self.scheduler.prefill_cap or 16):
            per_tok = elapsed_ms / plan.num_tokens
            prev = self._ms_per_prefill_token
            self._ms_per_prefill_token = per_tok if prev is None else 0.7 * prev + 0.3 * per_tok
            self.lifecycle.ms_per_recomputed_token = self._ms_per_prefill_token
        self._apply_inbox(adds=False)  # aborts that arrived during the forward win
        if result is not None:
            self._process(result, sampled)
        self.lifecycle.step_processed(plan.step_id)

    def _forward_and_sample(self, plan: StepPlan) -> tuple[StepResult, dict[tuple[int, int], Sampled]]:
        """The worker thread's part of an async step: the forward, then the sampling of every
        row that may need it (a request that ends meanwhile just wastes its sample). Keeping
        every parallel torch op on one thread matters: once two threads had each run OpenMP
        regions, libgomp counted more threads than cores and stopped spinning for all of
        them, and both modes ran at about half speed (measured: 18.7 -> 9.5 tok/s at one
        stream, 206 -> 121 at 32, for a synchronous engine in a process where an async one
        had run)."""
        result = self.runner.execute(plan, self._interrupt)
        result.bad_rows = bad_rows = self._bad_rows(result)
        tasks = [SampleTask(result.logit_index[ci], m)
                 for ci, ch in enumerate(plan.chunks)
                 if ch.sample and ch.req.status is RequestStatus.RUNNING
                 and result.logit_index[ci] not in bad_rows
                 for m in [ch.req, *ch.req.forks_pending]]
        samples = sample(result.logits, tasks, self.outputs.eos) if tasks else []
        return result, {(t.row, id(t.req)): s for t, s in zip(tasks, samples, strict=True)}

    @staticmethod
    def _bad_rows(result: StepResult) -> set[int]:
        """Rows no token can be drawn from: a NaN or +inf anywhere (a broken forward), or
        nothing above -inf. Sampling would turn them into an arbitrary token."""
        if result.bad_rows is not None:
            return result.bad_rows
        if not result.logits.numel():
            return set()
        # max propagates NaN and is +inf / -inf in the other cases: one cheap reduction
        # (isnan().any() cost ~10x more at 32 rows).
        finite = torch.isfinite(result.logits.amax(dim=-1)).tolist()
        return {i for i, ok in enumerate(finite) if not ok}

    def _process(self, result: StepResult,
                 sampled: dict[tuple[int, int], Sampled] | None = None) -> None:
        plan = result.plan
        tasks: list[SampleTask] = []
        bad_rows = self._bad_rows(result)
        for ci, ch in enumerate(plan.chunks):
            req = ch.req
            req.inflight_samples = req.inflight_tokens = 0
            if req.status is not RequestStatus.RUNNING:
                continue  # ended while the step ran; the lifecycle counted what it wasted
            self._register_prefix(req)
            if not ch.sample:
                continue
            row = result.logit_index[ci]
            if row in bad_rows:
                self.lifecycle.fail(req, FinishReason.ERROR, "the model produced NaN or infinite logits")
                continue
            tasks += [SampleTask(row, m) for m in [req, *req.forks_pending]]
        if not tasks:
            return
        if sampled is not None and all((t.row, id(t.req)) in sampled for t in tasks):
            samples = [sampled[(t.row, id(t.req))] for t in tasks]
        else:
            samples = sample(result.logits, tasks, self.outputs.eos)
        for task, s in zip(tasks, samples, strict=True):
            req = task.req
            if req.fork_leader is not None:
                self._fork(req)
            if req.status is not RequestStatus.RUNNING:
                continue
            try:
                stop = self.outputs.append(req, s.token_id, s.logprob)
            except Exception as exc:  # a stop check that fails ends only its own request
                self.lifecycle.fail(req, FinishReason.ERROR, f"output processing failed: {exc!r}")
                continue
            if stop is None and self.config.async_scheduling:
                self._text_pending.append(req)  # detokenized while the next forward runs
            else:
                self._text(req, stop)

    def _text(self, req: Request, stop: Stop | None) -> None:
        """Text phase of one request: detokenize, check stop strings, emit or finish."""
        try:
            stop = self.outputs.catch_up(req) or stop
        except Exception as exc:
            self.lifecycle.fail(req, FinishReason.ERROR, f"output processing failed: {exc!r}")
            return
        if stop is not None:
            self.lifecycle.finish(req, *stop)
        else:
            self.outputs.step_output(req)

    def _text_phase(self) -> None:
        pending, self._text_pending = self._text_pending, []
        for req in pending:
            if req.status is RequestStatus.RUNNING:  # not aborted meanwhile
                self._text(req, None)
        if pending and self.output_sink is not None:
            self.output_sink(self.outputs.collect())

    def _fork(self, member: Request) -> None:
        """A family sample takes its own copy of the leader's last, partial prompt block."""
        leader = member.fork_leader
        assert leader is not None
        bs = self.pool.block_size
        if member.prompt_len % bs:
            last = member.prompt_len // bs
            self.kv.copy_block(leader.block_ids[last], member.block_ids[last])
        member.num_computed = member.prompt_len
        member.num_cached = leader.num_cached
        member.last_scheduled_step = leader.last_scheduled_step
        member.fork_leader = None
        leader.forks_pending.remove(member)

    def _register_prefix(self, req: Request) -> None:
        if not self.config.enable_prefix_caching:
            return
        # Generated blocks too: a preempted request finds them again when it resumes (its
        # recompute shrinks to what was evicted meanwhile), as does any request that shares
        # the whole prefix.
        n_full = req.num_computed // self.pool.block_size
        if n_full <= req.num_hashed_blocks:
            return
        hashes = self.scheduler.block_hashes(req, n_full)
        for i in range(req.num_hashed_blocks, n_full):
            self.pool.register(req.block_ids[i], hashes[i])
        req.num_hashed_blocks = n_full

    # ---- inbox, deadlines, terminal outputs --------------------------------------------
    def _apply_inbox(self, adds: bool = True) -> None:
        """Register new families, apply aborts, then (at a step boundary) queue the adds.
        A request aborted before it was ever scheduled still gets its terminal output."""
        with self._lock:
            aborts, self._inbox_aborts = self._inbox_aborts, []
            new, self._inbox_adds = self._inbox_adds, []
            self._aborting.clear()
        for fam in new:
            self.families[fam.request_id] = fam
            for m in fam.members:
                self.outputs.start(m)
            self._to_schedule.append(fam)
        for rid, source in aborts:
            fam = self.families.get(rid)
            for m in fam.live() if fam is not None else ():
                self.lifecycle.abort(m, source)
        if adds:
            for fam in self._to_schedule:
                if not fam.members[0].status.is_finished:
                    self.scheduler.add(fam.members[0])
            self._to_schedule = []

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for fam in list(self.families.values()):
            for r in fam.live():
                p = r.params
                late = p.deadline is not None and now - r.arrival > p.deadline
                if (p.queue_timeout is not None and r.first_scheduled is None
                        and now - r.arrival > p.queue_timeout):
                    late = True
                if late:
                    self.lifecycle.abort(r, AbortSource.DEADLINE)

    def _on_terminal(self, req: Request) -> None:
        self.outputs.terminal(req)
        fam = req.family
        if fam is not None and not fam.live() and self.families.get(fam.request_id) is fam:
            del self.families[fam.request_id]  # the id may be reused from now on

    # ---- checks -------------------------------------------------------------------------
    def live_requests(self) -> list[Request]:
        return [r for fam in self.families.values() for r in fam.live()]

    def audit(self) -> None:
        """The ledger contract: raises LedgerError on any leak or double count."""
        self.pool.audit(self.lifecycle.held_tables(self.live_requests()))
        if not self.families and self.pool.num_used != 0:
            raise LedgerError(f"idle engine holds {self.pool.num_used} blocks")
        # Decode rows are freed by the forward's thread when a request is absent from the
        # next decode set (with async scheduling the release may run while a forward uses
        # them), so a stopped request's row may outlive it by a step, but never the engine's
        # going idle.
        if not self.families and self.runner.rows is not None and self.runner.rows.k:
            raise LedgerError("idle engine still holds decode rows")
