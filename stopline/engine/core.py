"""The engine core: the loop, the inbox, deadlines and the audit — one step at a time.

A step goes down once and comes back once: apply the inbox, schedule, run the plan on the
worker (worker/step.py: forward, sampling, grammar masks, verify; it returns a StepOutcome),
apply the aborts that arrived meanwhile, apply the outcome (apply.py), collect the outputs.

Threading: `add_request`, `abort` and `pause` may be called from any thread; they only record
the wish (inbox.py). Everything else runs on the thread that calls `step()`, which applies the
inbox at every step boundary (and aborts again right after the forward pass, so a token
computed for a request whose abort arrived mid-step is never delivered). If every request of
the step in flight is aborted, the forward stops at the next layer boundary.

Per-request state lives in the holders declared here, in release order (lifecycle.py):
grammar, queues, draft tokens, outputs (detokenizer), decode rows, the family table, swap
slots, the role's holders (a split's transfers: engine/role.py), and the KV manager last.
The core is never subclassed: a split's side is a role it calls at fixed points.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from stopline.config import AttentionBackend, EngineConfig, PreemptionMode
from stopline.engine.adapters import Adapters
from stopline.engine.apply import StepApplier
from stopline.engine.families import FamilyTable, check_request, new_family
from stopline.engine.grammars import GrammarHolder
from stopline.engine.inbox import Inbox
from stopline.engine.output import OutputProcessor, RequestOutput
from stopline.engine.residency import Residency
from stopline.engine.role import Role
from stopline.kv.block_pool import LedgerError
from stopline.kv.kv_cache import layer_groups, make_cache
from stopline.kv.manager import KVManager
from stopline.lifecycle import Holder, Lifecycle
from stopline.model.decoder_native import StepInterrupt
from stopline.model.llama import LlamaModel, StepInterrupted
from stopline.model.loaders.loader import LoadedModel, load_model
from stopline.request import (
    AbortSource,
    Family,
    FinishReason,
    InvalidRequest,
    Request,
    SamplingParams,
    UnknownAdapter,
)
from stopline.sched.plan import StepPlan
from stopline.sched.queues import Queues
from stopline.sched.scheduler import Scheduler
from stopline.spec.drafts import Drafts
from stopline.stats import StopStats
from stopline.worker.runner import ModelRunner
from stopline.worker.step import Forward, StepOutcome, StepWorker, Worker

log = logging.getLogger("stopline.engine")

_incarnations = itertools.count()
# What a core is built from: a loaded model, a GGUF file or HF directory, or None (the embedded model).
ModelSource = LoadedModel | str | None


class EngineCore:
    def __init__(self, model: ModelSource = None, config: EngineConfig | None = None,
                 *, progress: bool = True, runner: Forward | None = None,
                 worker: Worker | None = None, role: Role | None = None) -> None:
        """runner: run forwards with this instead of the model (tests drive the stop path
        with hand-built logits); worker: run whole steps with this (tests hand-build each
        step's outcome). The model then only gives its config and tokenizer. role: the
        plug-in for one side of a prefill/decode split (engine/role.py); default: one engine."""
        self.config = cfg = config or EngineConfig()
        # Wakes the loop that steps this core (core_loop.py sets it). A split's link thread
        # calls it from the moment the role binds, before any loop exists: a no-op till then.
        self.wake: Callable[[], None] = lambda: None
        # Denormal activations make CPU matmuls several times slower; they carry no signal.
        torch.set_flush_denormal(True)
        loaded = model if isinstance(model, LoadedModel) else load_model(model, progress=progress)
        self.loaded = loaded
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        # One block pool per layer group (Gemma 3: its global and its local layers).
        layer_group, windows = layer_groups(mc.layer_windows)
        self.pools, self.kv, swap = make_cache(cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, layer_group,
                                               windows)
        self.pool = self.pools[0]
        self.model: LlamaModel | None = None
        if runner is None and worker is None:
            runner = ModelRunner.for_model(loaded, self.kv, cfg)
            self.model = runner.model
        if self.model is None or self.model.attention is AttentionBackend.TORCH:
            # Torch attention multiplies whole blocks by masked weights: unwritten slots must
            # hold zeros, not a freed block's NaN. The C kernel reads written slots only.
            for g, pool in enumerate(self.pools):
                pool.on_allocate = self.kv.zero if len(self.pools) == 1 else functools.partial(self.kv.zero, group=g)
        self.runner: Forward | None = runner
        self.stats = StopStats()
        self.kv_manager = KVManager(self.pool, self.kv, swap, self.stats,
                                    prefix_caching=cfg.enable_prefix_caching,
                                    keep_aborted_prefix=cfg.keep_aborted_prefix,
                                    window=windows[0], more=list(zip(self.pools[1:], windows[1:], strict=True)))
        self.queues = Queues()
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len,
                                       cached=self.kv_manager.cached)
        self.families = FamilyTable()
        self.grammar = GrammarHolder(self.tokenizer, mc.vocab_size, deadline_s=cfg.grammar_deadline,
                                     max_rows=cfg.max_num_seqs)
        # THE release order (lifecycle.py): auxiliary state first (grammar matchers and
        # compile tickets before all), KV blocks last. Draft tokens go before the outputs:
        # the terminal output's usage counts the drafts of a step in flight as discarded.
        self.drafts = Drafts(cfg, self.stats, self.max_model_len)
        self.worker: Worker = worker or StepWorker(runner, mc.eos_token_ids, self.grammar)
        # LoRA references: auxiliary state, released before the outputs count the tokens.
        self.adapters = Adapters(mc, self.model.adapters if self.model is not None else {},
                                 max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank,
                                 max_cpu_loras=cfg.max_cpu_loras)
        if self.model is not None:
            self.model.lora_slots = self.adapters.slots
        self.kv_manager.salt = self.adapters.salt  # no prefix reuse across adapters
        holders: list[Holder] = [self.grammar, self.queues, self.drafts, self.adapters, self.outputs]
        if self.worker.rows is not None:
            holders.append(self.worker.rows)
        holders.append(self.families)
        self.role = role or Role()
        holders += self.role.bind(self)  # the role's holders: after the core's, before the blocks
        holders.append(self.kv_manager)
        self.lifecycle = Lifecycle(cfg, self.kv_manager, holders, self.stats)
        self.scheduler = Scheduler(cfg, self.kv_manager, self.queues, self.lifecycle, self.drafts)
        self.scheduler.resident = self.adapters.resident  # a request waits for its adapter's slot
        self.applier = StepApplier(self.lifecycle, self.kv_manager, self.outputs, self.grammar, self.drafts,
                                   defer_text=cfg.async_scheduling, prefilled=self.role.prefilled)
        if cfg.preemption_mode is PreemptionMode.AUTO:
            self.lifecycle.calibrate_swap()
        self._rng = random.Random(cfg.seed)
        self.inbox = Inbox()
        self._to_schedule: list[Family] = []
        self._inflight_ids: set[str] = set()
        self._interrupt = StepInterrupt()  # an Event the C decoder loop can read too
        self.steps = 0
        self.interrupted_steps = 0
        # Steps that ran a forward, and their seconds from the step's start to its outcome
        # applied: the engine's side of a served token (tools/token_path.py sets the rest beside it).
        self.busy_steps = 0
        self.busy_seconds = 0.0
        self.execute_seconds = 0.0  # of those, the worker's run (forward and sampling)
        # Async scheduling: the worker's step (the forward, then its sampling) runs on this
        # thread pool's one thread (torch releases the GIL) while this thread detokenizes
        # and emits the previous step's tokens.
        self._worker = ThreadPoolExecutor(1, "stopline-forward") if cfg.async_scheduling else None
        # Where outputs go as soon as they are ready (the async engine sets it); otherwise
        # step() returns them.
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        # A core that takes a prompt's KV from another process (a split's decode role) names
        # the incarnations here the moment it takes them: their sender is no longer needed.
        self.taken_sink: Callable[[list[str]], None] | None = None
        # What it holds resident: sleep and wake, weight updates, LoRA loads, the halt (residency.py).
        self.residency = Residency(self, model)

    # ---- entry points (any thread) ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams | None = None, arrival: float | None = None,
                    incarnation: str | None = None) -> str:
        """Validate and queue a request; returns its incarnation (minted unless given), the
        name every later abort or pause of it uses. Raises InvalidRequest (nothing is queued)
        if it can't be served: empty or over-long prompt, bad parameters, an incarnation in
        use."""
        params = params or SamplingParams()
        prompt = check_request(prompt_token_ids, params, self.model_config.vocab_size,
                               self.max_model_len, self.config.max_num_seqs)
        if params.lora is not None and not self.adapters.serves(params.lora):
            raise UnknownAdapter(f"model: {params.lora!r} is neither the base model nor a loaded adapter")
        short = self.kv_manager.short(len(prompt), params.n - 1)
        if short is not None:
            raise InvalidRequest(f"prompt: needs {short[0]} KV blocks; the pool has {short[1]}")
        inc = incarnation if incarnation is not None else f"{request_id}#{next(_incarnations)}"
        family = new_family(request_id, prompt, params, time.monotonic() if arrival is None else arrival,
                            inc, params.seed if params.seed is not None else self._rng.getrandbits(63))
        if not self.inbox.add(family, self.families.by_incarnation):
            raise InvalidRequest(f"incarnation {inc!r} is already in use")
        return inc

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> None:
        """Ask for requests to end with finish_reason 'abort' (t0: time.monotonic() when the
        abort was asked). An incarnation that ended is ignored; one not added yet is aborted
        when it is, if that is within EARLY_TTL seconds of t0; asking twice is the same as once."""
        incs = list(incarnations)
        self.inbox.abort(incs, source, t0)
        with self.inbox.lock:
            if self._inflight_ids and self._inflight_ids <= self.inbox.aborting:
                self._interrupt.set()

    def pause(self, incarnations: str | Iterable[str], paused: bool = True) -> None:
        """A paused request keeps its place but takes no step (its client's stream is full)."""
        self.inbox.pause([incarnations] if isinstance(incarnations, str) else list(incarnations), paused)

    # ---- the step -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return (self.role.messages() or self.role.holding() or bool(self.families)
                or self.inbox.has_any() or bool(self._text_pending))

    def all_paused(self) -> bool:
        """Work exists but none can run: every live request is paused (its client's stream is
        full) or waits for its role, nothing else pending. The loop then waits for a message
        or `wake_at`."""
        live = self.families.live_requests()
        return (not self.role.messages() and bool(live) and all(r.paused or self.role.idle(r) for r in live)
                and not self.inbox.has_any() and not self._text_pending)

    def wake_at(self) -> float:
        """time.monotonic() by which an all-paused core must step with no message (the role's
        deadlines); inf: none. Request deadlines are the loop's."""
        return self.role.wake_at()

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.role.step_start()
        self._apply_inbox()  # aborts first, then adds
        self.role.after_inbox()
        self._check_deadlines()
        plan = self._schedule()
        if plan.chunks:
            t0 = time.perf_counter()
            outcome = self._execute(plan)  # the worker's StepOutcome; None: interrupted or failed
            self._apply_aborts()  # aborts that arrived during the forward win: their rows are void
            if outcome is not None:
                self.applier.apply(outcome)
                self.drafts.observe([(c.num_tokens, len(c.drafts)) for c in plan.chunks], t0)
            self.kv_manager.step_processed(plan.step_id)  # blocks fenced by the step go back
            self.busy_steps += 1
            self.busy_seconds += time.perf_counter() - start
        else:
            self._text_phase()
            # Nothing to run: requests wait for their grammar at most. Sleep until a compile
            # ends rather than spin (a few ms; deadlines are checked every step).
            if not self._text_pending:
                self.grammar.idle_wait(0.005)
        if not self.families and self.worker.rows is not None:
            self.worker.rows.reset()  # an idle engine keeps no copies of K/V
        self.adapters.reap()  # adapters unloading with `wait` go with their last request
        if self.config.debug:
            self.audit()
        elif self.config.audit_every and self.steps % self.config.audit_every == 0:
            self._sampled_audit()
        self.steps += 1
        return self.outputs.collect()

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.adapters.ran([c.req.params.lora for c in plan.chunks])
        if self.config.debug and any(c.req.paused for c in plan.chunks):  # docs/stop-path.md
            raise LedgerError(f"a paused request is in step {plan.step_id}: "
                              f"{[c.req.incarnation for c in plan.chunks if c.req.paused]}")
        return plan

    def _execute(self, plan: StepPlan) -> StepOutcome | None:
        """Run the plan on the worker: on this thread, or (async scheduling) on the forward
        thread while this one runs the previous step's text phase. A failed step ends every
        live request with an error, none hangs."""
        with self.inbox.lock:
            self._inflight_ids = {c.req.incarnation for c in plan.chunks}
            self._interrupt.clear()
            if self._inflight_ids <= self.inbox.aborting:
                self._interrupt.set()
        t0 = time.perf_counter()
        outcome: StepOutcome | None = None
        try:
            if self._worker is not None:
                future: Future = self._worker.submit(self.worker.run, plan, self._interrupt)
                try:
                    self._text_phase()
                finally:
                    wait([future])  # the forward writes KV blocks: nothing is freed before it ends
                outcome = future.result()
            else:
                outcome = self.worker.run(plan, self._interrupt)
        except StepInterrupted:
            self.interrupted_steps += 1
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            self._apply_aborts()
            for r in self.families.live_requests():
                self.lifecycle.fail(r, FinishReason.ERROR, f"engine step failed: {exc!r}")
        finally:
            with self.inbox.lock:
                self._inflight_ids = set()
        took = time.perf_counter() - t0
        self.execute_seconds += took
        self.scheduler.measured(plan, took * 1000)
        return outcome

    @property
    def _text_pending(self) -> list[Request]:
        return self.applier.text_pending

    def _text_phase(self) -> None:
        if self.applier.text_phase() and self.output_sink is not None:
            self.output_sink(self.outputs.collect())

    def flush_text(self) -> None:
        """Emit the outputs whose text is still pending (async scheduling) now."""
        if self._text_pending:
            self._text_phase()

    # ---- inbox, deadlines ----------------------------------------------------------------
    def _apply_inbox(self) -> None:
        """Register new families, apply aborts and pauses, then queue the adds. A request
        aborted before it was ever scheduled still gets its terminal output."""
        taken = self.inbox.take()
        for fam in taken.adds:
            self.families.add(fam)
            for m in fam.members:
                self.outputs.start(m)
            self._to_schedule.append(fam)
            if not all([self.adapters.hold(m) for m in fam.members]):
                self._abort_family(fam, AbortSource.UNLOAD)  # its adapter went since add_request
        self._abort_all(taken.aborts)
        self.inbox.expire()
        for fam in taken.adds:
            source = self.inbox.early_abort(fam.incarnation)
            if source is not None:
                self._abort_family(fam, source)
        self._pause_all(taken.pauses)
        for fam in self._to_schedule:
            if not fam.members[0].status.is_finished and not self.role.admit(fam):
                self.admit(fam)
        self._to_schedule = []
        for fam in self.grammar.poll(self._grammar_failed):
            self.scheduler.add(fam.members[0])

    def admit(self, fam: Family) -> None:
        """A new family joins the scheduler's queue, once its grammar is compiled."""
        if fam.members[0].params.grammar is not None:
            self.grammar.wait(fam)  # joins the queue once its grammar is compiled
        else:
            self.scheduler.add(fam.members[0])

    def _grammar_failed(self, req: Request, why: str) -> None:
        self.lifecycle.fail(req, FinishReason.ERROR, f"grammar: {why}")

    def _apply_aborts(self) -> None:
        """Aborts only (mid-step): adds wait for the next step boundary."""
        taken = self.inbox.take(adds=False)
        self._abort_all(taken.aborts)
        self._pause_all(taken.pauses)

    def _pause_all(self, pauses: list[tuple[str, bool]]) -> None:
        for inc, paused in pauses:
            self.families.pause(inc, paused)

    def _abort_all(self, aborts: list[tuple[str, AbortSource, float]]) -> None:
        for inc, source, t0 in aborts:
            fam = self.families.get(inc)
            if fam is None:
                self.inbox.keep_early(inc, source, t0)
            else:
                self._abort_family(fam, source)

    def _abort_family(self, fam: Family, source: AbortSource) -> None:
        for m in fam.live():
            self.lifecycle.abort(m, source)

    def _check_deadlines(self) -> None:
        """Deadlines and queue timeouts apply to a family as a whole: its samples share a
        prompt, an arrival and (until the fork) the leader's steps."""
        now = time.monotonic()
        for fam in list(self.families):
            first = fam.members[0]
            p = first.params
            late = p.deadline is not None and now - first.arrival > p.deadline
            if (p.queue_timeout is not None and first.first_scheduled is None
                    and now - first.arrival > p.queue_timeout):
                late = True
            if late:
                self._abort_family(fam, AbortSource.DEADLINE)

    # ---- checks -------------------------------------------------------------------------
    def live_requests(self) -> list[Request]:
        return self.families.live_requests()

    def close(self) -> None:
        """Stop the role's threads and sockets (tests; a role's process just exits)."""
        self.role.close()

    def _sampled_audit(self) -> None:
        """The audit on a busy step (audit_every): a finding is logged and counted, not
        raised, so a production server keeps serving while the log and /metrics say it."""
        stats = self.stats
        t0 = time.perf_counter()
        try:
            self.audit()
        except LedgerError as exc:
            stats.audit_failures += 1
            log.error("ownership audit failed at step %d: %s", self.steps, exc)
        finally:
            stats.audits += 1
            stats.audit_seconds += time.perf_counter() - t0

    def audit(self) -> None:
        """The ledger contract: raises LedgerError on any leak, double count, or holder still
        holding a finished request."""
        self.lifecycle.audit(self.live_requests())
        for fam in self.families:  # the family table: live families only, each under its own name
            if not fam.live() or self.families.get(fam.incarnation) is not fam:
                raise LedgerError(f"family {fam.incarnation!r} is in the table with no live sample")
        self.grammar.audit(self.live_requests())
        self.adapters.audit(self.live_requests())
        if not self.families and self.kv_manager.num_used != 0:
            raise LedgerError(f"idle engine holds {self.kv_manager.num_used} blocks")
        # Decode rows are dropped by the forward's thread at its next step (with async
        # scheduling the release may run while a forward uses them), so a stopped request's
        # row may outlive it by a step, but never the engine's going idle.
        rows = self.worker.rows
        if not self.families and rows is not None and rows.k:
            raise LedgerError("idle engine still holds decode rows")
        self.role.audit(self.live_requests())
