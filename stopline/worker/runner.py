"""Builds a step's model inputs from the scheduler's plan and runs the forward pass."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import torch

from stopline.config import AttentionBackend, EngineConfig
from stopline.kv.decode_rows import DecodeRows, RowPlan
from stopline.kv.kv_cache import KVCache
from stopline.model.attention import KEY_TILE
from stopline.model.batch_invariant import threads_pinned
from stopline.model.kernels.paged_attention import PagedRows
from stopline.model.llama import DecodeBatch, LlamaModel, PrefillSeq, StepInputs
from stopline.model.loaders.loader import LoadedModel
from stopline.model.lora import LoraRows
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.worker.cpu_share import CpuShare, ThreadPolicy


@dataclass
class _Rows:
    """A step's rows, in chunk order."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # where each row's K/V goes
    starts: list[int] = field(default_factory=list)  # first row of each chunk
    logit_rows: list[int] = field(default_factory=list)
    logit_index: dict[int, int] = field(default_factory=dict)  # chunk index -> its first row of logits
    score_index: dict[int, int] = field(default_factory=dict)  # chunk index -> first row scoring its prompt


@dataclass
class StepResult:
    plan: StepPlan
    logits: torch.Tensor  # [rows of logits, vocab]: one per sampling chunk, 1 + drafts per verify
    logit_index: dict[int, int]  # chunk index -> its first row of logits (consecutive rows)
    bad_rows: set[int] | None = None  # rows of logits with a NaN or an inf, once looked at
    # chunk index -> the first of its num_scored rows of prompt-scoring logits (after every
    # sampled row, so those keep their place)
    score_index: dict[int, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, config: EngineConfig) -> None:
        self.model = model
        self.kv = kv
        self.config = config
        self.bs = kv.block_size
        self.device = config.device
        # Block tables are padded (with the zero block, masked) to whole attention tiles, so
        # attention never pads the gathered keys and values with another copy.
        self.tile_blocks = KEY_TILE // self.bs if KEY_TILE % self.bs == 0 else 1
        self.rows: DecodeRows | None = None
        self.paged = model.attention is AttentionBackend.NATIVE  # reads the cache in place: no rows to keep
        share = CpuShare() if config.adapt_threads and self.device == "cpu" else None
        self.threads = ThreadPolicy(torch.get_num_threads(), share)
        if config.decode_rows and not self.paged:
            mc = model.config
            pool_bytes = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
            self.rows = DecodeRows(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.bs, KEY_TILE,
                                   max_rows=config.max_num_seqs, max_bytes=2 * pool_bytes,
                                   verify=config.debug, device=self.device,
                                   null_block=kv.nulls, layer_group=kv.layer_group)
        self._staged: RowPlan | None = None  # this step's decode rows, for every layer group

    @classmethod
    def for_model(cls, loaded: LoadedModel, kv: KVCache, config: EngineConfig) -> ModelRunner:
        """The loaded model's network, calibrated, and a runner over it."""
        return cls(cls.build_model(loaded, config), kv, config)

    @staticmethod
    def build_model(loaded: LoadedModel, config: EngineConfig) -> LlamaModel:
        """The network of loaded weights, calibrated (also for a weight update in place)."""
        cfg, mc = config, loaded.config
        model = LlamaModel(mc, loaded.weights, max_rows=cfg.max_num_batched_tokens,
                           max_logit_rows=cfg.max_num_seqs, device=cfg.device,
                           linear_backend=cfg.linear_backend, blocks=loaded.blocks,
                           quant_max_rows=cfg.quant_max_rows, attention=cfg.attention_backend,
                           numerics=cfg.numerics)
        model.calibrate()
        return model

    def _table(self, ch: ScheduledChunk, nb: int, group: int = 0) -> list[int]:
        """ch's first nb table entries in a layer group; those a sliding window passed (HOLE,
        given back) point at the group's zero block: the window masks them, and a given-back
        block may be anyone's."""
        table = ch.group_tables[group - 1] if group else ch.block_ids
        null = self.kv.nulls[group]
        return [b if b >= 0 else null for b in table[:nb]]

    def _slots(self, chunks: list[ScheduledChunk], group: int) -> list[int]:
        """Where each row's K/V goes in a layer group's blocks."""
        bs = self.bs
        slots: list[int] = []
        for ch in chunks:
            table = ch.group_tables[group - 1] if group else ch.block_ids
            slots += [table[pos // bs] * bs + pos % bs for pos in range(ch.start, ch.start + ch.num_tokens)]
        return slots

    def _width(self, nb: int) -> int:
        return -(-nb // self.tile_blocks) * self.tile_blocks

    def _rows(self, plan: StepPlan) -> _Rows:
        """Every row of the step: its token, position and cache slot, and the rows sampled."""
        bs = self.bs
        r = _Rows()
        scored: list[tuple[int, int]] = []  # (chunk index, row of its first scored position)
        for ci, ch in enumerate(plan.chunks):
            # Only the chunk's own copies: with async scheduling the request may end (and its
            # tables empty) while this runs on the worker thread.
            end = ch.start + ch.num_tokens
            r.starts.append(len(r.tokens))
            r.tokens += ch.token_ids
            span = range(ch.start, end)
            r.positions += span
            table = ch.block_ids
            r.slots += [table[pos // bs] * bs + pos % bs for pos in span]
            if ch.sample:
                # A verify chunk needs the next-token logits after its decode row and after
                # each draft: its last 1 + len(drafts) rows, attended causally like a prefill.
                r.logit_index[ci] = len(r.logit_rows)
                r.logit_rows += range(len(r.tokens) - ch.num_logits, len(r.tokens))
            if ch.num_scored:
                scored.append((ci, r.starts[-1] + ch.score_from - ch.start))
        for ci, row in scored:
            r.score_index[ci] = len(r.logit_rows)
            r.logit_rows += range(row, row + plan.chunks[ci].num_scored)
        return r

    def _inputs(self, r: _Rows, **attention) -> StepInputs:
        dev = self.device
        return StepInputs(
            token_ids=torch.tensor(r.tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(r.positions, dtype=torch.long, device=dev),
            write_slots=torch.tensor(r.slots, dtype=torch.long, device=dev),
            logit_rows=torch.tensor(r.logit_rows, dtype=torch.long, device=dev),
            **attention,
        )

    def prepare(self, plan: StepPlan) -> tuple[StepInputs, _Rows]:
        r = self._rows(plan)
        # A lone decode runs as two copies of itself where the GEMM libraries serve a linear:
        # each takes another path for one row than for two or more (so the linears would pad
        # it anyway, one copy per call), and rows never see each other. Both copies write the
        # same K/V to the same slot. Not needed where the quantized kernel runs every linear:
        # it gives one row the bits of the library's two.
        twice = len(r.tokens) == 1 and not self.model.one_row_ok  # one row: one chunk of one token
        if twice:
            r.tokens, r.positions, r.slots, r.logit_rows = r.tokens * 2, r.positions * 2, r.slots * 2, r.logit_rows * 2
            r.starts = [0, 1]
        chunks = plan.chunks * 2 if twice else plan.chunks
        prep = self._prepare_paged if self.paged else self._prepare_torch
        inputs = prep(r, chunks, 0)
        if len(self.kv.groups) > 1:  # each layer group reads its own tables and slots
            inputs.groups = [inputs] + [prep(replace(r, slots=self._slots(chunks, g)), chunks, g)
                                        for g in range(1, len(self.kv.groups))]
        inputs.lora = self._adapters(chunks, r.starts)
        return inputs, r

    def _adapters(self, chunks: list[ScheduledChunk], starts: list[int]) -> LoraRows | None:
        """Each row's adapter slot (-1: the base model); None: all rows are base."""
        if all(ch.req.params.lora is None for ch in chunks):
            return None
        slots = self.model.lora_slots
        slot = torch.full((sum(ch.num_tokens for ch in chunks),), -1, dtype=torch.int32)
        for ch, row0 in zip(chunks, starts, strict=True):
            name = ch.req.params.lora
            if name is not None:
                # The scheduler admits a request only once its adapter is resident, and the
                # engine never evicts an adapter a live request holds (engine/adapters.py).
                s = slots.index(name) if slots is not None else -1
                if s < 0:
                    raise RuntimeError(f"adapter {name!r} of a scheduled request is not resident")
                slot[row0:row0 + ch.num_tokens] = s
        return LoraRows(slot, slots)

    def _prepare_paged(self, r: _Rows, chunks: list[ScheduledChunk], group: int = 0) -> StepInputs:
        """Inputs for the native attention: each row attends its sequence's keys up to its own
        position, through the sequence's block table (of the layer group)."""
        tables: list[int] = []
        table_at: list[int] = []
        for ch in chunks:
            table_at += [len(tables)] * ch.num_tokens
            tables += self._table(ch, (ch.start + ch.num_tokens + self.bs - 1) // self.bs, group)
        # The group's zero block (its pool's size: holes a sliding window left) is inside
        # its layers' tensors, whose pools may differ in size.
        top = self.kv.nulls[group]
        if tables and not 0 <= min(tables) <= max(tables) <= top:
            # The kernel reads where the tables point: a bad entry would read out of bounds.
            raise RuntimeError(f"a block table points outside the KV pool of {top} blocks")
        return self._inputs(r, prefills=[], decode=None,
                            paged=PagedRows.build([p + 1 for p in r.positions], table_at, tables))

    def _prepare_torch(self, r: _Rows, chunks: list[ScheduledChunk], group: int = 0) -> StepInputs:
        """Inputs for torch attention: prefill chunks with padded tables (of the layer group)
        and causal masks, and the decodes in DecodeRows, or gathering their padded tables."""
        bs = self.bs
        prefills: list[PrefillSeq] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        dec_keys: list[int] = []
        for ch, row0 in zip(chunks, r.starts, strict=True):
            end = ch.start + ch.num_tokens
            if ch.num_tokens == 1:
                dec_rows.append(row0)
                dec_tables.append(self._table(ch, (end + bs - 1) // bs, group))
                dec_lens.append(end)
                dec_keys.append(ch.req.internal_id)
            else:
                nb = (end + bs - 1) // bs
                width = self._width(nb)
                table = torch.tensor(self._table(ch, nb, group) + [self.kv.nulls[group]] * (width - nb),
                                     dtype=torch.long)
                row_pos = torch.arange(ch.start, end)
                masked = torch.arange(width * bs)[None, :] > row_pos[:, None]  # causal
                prefills.append(PrefillSeq(row0, row0 + ch.num_tokens, table.to(self.device),
                                           masked.to(self.device)))
        decode = None
        if dec_rows:
            if group:  # the rows planned with group 0's inputs hold every group's K/V
                staged = self._staged
            else:
                more = [[self._table(ch, (ch.start + 1 + bs - 1) // bs, g) for ch in chunks if ch.num_tokens == 1]
                        for g in range(1, len(self.kv.groups))]
                staged = self.rows.plan(dec_keys, dec_lens, dec_tables, more) if self.rows else None
                self._staged = staged
            table = masked = None
            if staged is None:  # the decodes gather their blocks: padded tables and masks
                width = self._width(max(len(t) for t in dec_tables))
                null = self.kv.nulls[group]
                table = torch.tensor([t + [null] * (width - len(t)) for t in dec_tables],
                                     dtype=torch.long).to(self.device)
                lens = torch.tensor(dec_lens, dtype=torch.long)
                # Positions past a sequence's length (the rest of its last block, which is zero
                # until written, and the padding blocks, which point at the zero block) are masked.
                masked = (torch.arange(width * bs)[None, :] >= lens[:, None])[:, None, None, :].to(self.device)
            decode = DecodeBatch(torch.tensor(dec_rows, dtype=torch.long).to(self.device),
                                 all_rows=len(dec_rows) == len(r.tokens), blocks=table, masked=masked,
                                 staged=staged)
        return self._inputs(r, prefills=prefills, decode=decode)

    def _forward(self, inputs: StepInputs, interrupt: threading.Event | None) -> torch.Tensor:
        """The model's forward, on fewer threads when neighbours take our CPUs and the step
        allows it (worker/cpu_share.py); the count is back to full when it returns."""
        rows, full = inputs.token_ids.shape[0], self.threads.threads
        n = self.threads.pick(rows, lambda: self.model.own_kernels(rows, inputs.logit_rows.numel()))
        if n == full:
            return self.model.forward(inputs, self.kv, interrupt, self.rows)
        torch.set_num_threads(n)
        try:
            with threads_pinned(full):
                return self.model.forward(inputs, self.kv, interrupt, self.rows)
        finally:
            torch.set_num_threads(full)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepResult:
        try:
            inputs, r = self.prepare(plan)
            logits = self._forward(inputs, interrupt)
        except BaseException:
            if self.rows is not None:  # rows the failed step half wrote are rebuilt
                self.rows.reset()
            raise
        return StepResult(plan, logits.float().cpu(), r.logit_index, score_index=r.score_index)
