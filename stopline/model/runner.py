"""Builds a step's model inputs from the scheduler's plan and runs the forward pass."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from stopline.config import EngineConfig
from stopline.kv.decode_rows import DecodeRows
from stopline.kv.kv_cache import KVCache
from stopline.model.attention import KEY_TILE
from stopline.model.llama import DecodeBatch, LlamaModel, PrefillSeq, StepInputs
from stopline.model.paged_attention import PagedRows
from stopline.sched.scheduler import StepPlan


@dataclass
class StepResult:
    plan: StepPlan
    logits: torch.Tensor  # [number of sampling chunks, vocab]
    logit_index: dict[int, int]  # chunk index -> row of logits
    nan_rows: set[int] | None = None  # rows of logits with a NaN, once looked at


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
        self.paged = model.attention == "native"  # reads the cache in place: no rows to keep
        if config.decode_rows and not self.paged:
            mc = model.config
            pool_bytes = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
            self.rows = DecodeRows(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.bs, KEY_TILE,
                                   max_rows=config.max_num_seqs, max_bytes=2 * pool_bytes,
                                   verify=config.debug, device=self.device)

    def _width(self, nb: int) -> int:
        return -(-nb // self.tile_blocks) * self.tile_blocks

    def prepare(self, plan: StepPlan) -> tuple[StepInputs, dict[int, int]]:
        if self.paged:
            return self._prepare_paged(plan)
        bs = self.bs
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        dec_keys: list[int] = []
        logit_rows: list[int] = []
        logit_index: dict[int, int] = {}
        for ci, ch in enumerate(plan.chunks):
            req = ch.req
            row0 = len(tokens)
            end = ch.start + ch.num_tokens
            all_ids = req.prompt_token_ids if end <= req.prompt_len else req.all_token_ids
            tokens += all_ids[ch.start:end]
            for pos in range(ch.start, end):
                positions.append(pos)
                slots.append(req.block_ids[pos // bs] * bs + pos % bs)
            if ch.num_tokens == 1:
                dec_rows.append(row0)
                dec_tables.append(req.block_ids[: (end + bs - 1) // bs])
                dec_lens.append(end)
                dec_keys.append(req.internal_id)
            else:
                nb = (end + bs - 1) // bs
                width = self._width(nb)
                table = torch.tensor(req.block_ids[:nb] + [self.kv.null_block] * (width - nb), dtype=torch.long)
                row_pos = torch.arange(ch.start, end)
                masked = torch.arange(width * bs)[None, :] > row_pos[:, None]  # causal
                prefills.append(PrefillSeq(row0, row0 + ch.num_tokens, table.to(self.device),
                                           masked.to(self.device)))
            if ch.sample:
                logit_index[ci] = len(logit_rows)
                logit_rows.append(len(tokens) - 1)
        if len(tokens) == 1 and dec_rows and not self.model.one_row_ok:
            # A lone decode runs as two copies of itself: every GEMM library here takes
            # another path for one row than for two or more (so the linears would pad it
            # anyway, one copy per call), and rows never see each other. Both copies write
            # the same K/V to the same slot. Not needed where the quantized kernel runs
            # every linear: it gives one row the bits of the library's two.
            tokens, positions, slots = tokens * 2, positions * 2, slots * 2
            dec_rows, dec_tables, dec_lens, dec_keys = [0, 1], dec_tables * 2, dec_lens * 2, dec_keys * 2
            logit_rows = logit_rows * 2
        decode = None
        if dec_rows:
            staged = self.rows.plan(dec_keys, dec_lens, dec_tables) if self.rows else None
            table = masked = None
            if staged is None:  # the decodes gather their blocks: padded tables and masks
                width = self._width(max(len(t) for t in dec_tables))
                null = self.kv.null_block
                table = torch.tensor([t + [null] * (width - len(t)) for t in dec_tables],
                                     dtype=torch.long).to(self.device)
                lens = torch.tensor(dec_lens, dtype=torch.long)
                # Positions past a sequence's length (the rest of its last block, which is zero
                # until written, and the padding blocks, which point at the zero block) are masked.
                masked = (torch.arange(width * bs)[None, :] >= lens[:, None])[:, None, None, :].to(self.device)
            decode = DecodeBatch(torch.tensor(dec_rows, dtype=torch.long).to(self.device),
                                 all_rows=len(dec_rows) == len(tokens), blocks=table, masked=masked,
                                 staged=staged)
        dev = self.device
        inputs = StepInputs(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            write_slots=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills, decode=decode,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return inputs, logit_index

    def _prepare_paged(self, plan: StepPlan) -> tuple[StepInputs, dict[int, int]]:
        """Inputs for the native attention: each row attends its sequence's keys up to its own
        position, through the sequence's block table."""
        bs = self.bs
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[int] = []
        table_at: list[int] = []
        logit_rows: list[int] = []
        logit_index: dict[int, int] = {}
        for ci, ch in enumerate(plan.chunks):
            req = ch.req
            end = ch.start + ch.num_tokens
            all_ids = req.prompt_token_ids if end <= req.prompt_len else req.all_token_ids
            tokens += all_ids[ch.start:end]
            span = range(ch.start, end)
            positions += span
            blocks = req.block_ids
            slots += [blocks[pos // bs] * bs + pos % bs for pos in span]
            table_at += [len(tables)] * ch.num_tokens
            tables += blocks[: (end + bs - 1) // bs]
            if ch.sample:
                logit_index[ci] = len(logit_rows)
                logit_rows.append(len(tokens) - 1)
        if tables and not 0 <= min(tables) <= max(tables) < self.kv.num_blocks:
            # The kernel reads where the tables point: a bad entry would read out of bounds.
            raise RuntimeError(f"a block table points outside the KV pool of {self.kv.num_blocks} blocks")
        if len(tokens) == 1 and not self.model.one_row_ok:
            # The GEMM libraries take another path for one row than for two (see prepare).
            tokens, positions, slots, table_at = tokens * 2, positions * 2, slots * 2, table_at * 2
            logit_rows = logit_rows * 2
        dev = self.device
        inputs = StepInputs(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            write_slots=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=[], decode=None,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            paged=PagedRows.build([p + 1 for p in positions], table_at, tables),
        )
        return inputs, logit_index

    @torch.inference_mode()
    def execute(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepResult:
        try:
            inputs, logit_index = self.prepare(plan)
            logits = self.model.forward(inputs, self.kv, interrupt, self.rows)
        except BaseException:
            if self.rows is not None:  # rows the failed step half wrote are rebuilt
                self.rows.reset()
            raise
        return StepResult(plan, logits.float().cpu(), logit_index)
