"""Engine settings. Every choice the design brief calls measurable is a field here."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass


class Choice(str, enum.Enum):
    """A setting's named choice: compares equal to its string, prints as it."""

    def __str__(self) -> str:
        return self.value


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"  # per victim: whichever of recompute and swap costs less


class VictimPolicy(str, enum.Enum):
    NEWEST = "newest"  # vLLM: the most recently admitted
    FEWEST_OUTPUT = "fewest-output"  # SGLang: fewest outputs, then longest prompt
    LONGEST_OUTPUT = "longest-output"  # DeepInfer
    LEAST_COMPUTED = "least-computed"
    PRIORITY = "priority"  # largest priority value first, newest among equals
    COST = "cost"  # frees the needed blocks for the least wasted work


class LinearBackend(Choice):
    """GEMM libraries a linear layer may use (see stopline/model/batch_invariant.py)."""

    AUTO = "auto"
    BLAS = "blas"
    ONEDNN = "onednn"


class AttentionBackend(Choice):
    """stopline's C kernel reading the paged cache in place (model/kernels/paged_attention.py),
    or torch's ops over gathered or copied K/V (model/attention.py, kv/decode_rows.py)."""

    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"


class SpecMode(Choice):
    """Speculative decoding by n-gram lookup over a request's own tokens (stopline/spec/)."""

    OFF = "off"
    ON = "on"  # draft wherever the n-gram index finds a continuation
    AUTO = "auto"  # draft only where the measured acceptance and step costs say it pays


class Numerics(Choice):
    """Arithmetic of the linear layers (docs/numerics.md); both are batch-invariant."""

    EXACT = "exact"  # float32 bits: greedy equals the HF oracle
    FAST = "fast"  # bf16 inputs, fp32 sums (AVX512-BF16); exact where the CPU lacks it


class KVCacheDtype(Choice):
    """What the KV cache holds (docs/numerics.md "The int8 KV cache")."""

    AUTO = "auto"  # float32, the model's compute dtype
    FLOAT32 = "float32"
    INT8 = "int8"  # int8 quants and a float32 scale per (kv head, token); fast numerics only


KV_CACHE_DTYPES = tuple(d.value for d in KVCacheDtype)
LINEAR_BACKENDS = tuple(b.value for b in LinearBackend)
ATTENTION_BACKENDS = tuple(b.value for b in AttentionBackend)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size (the global layers'); otherwise from kv_cache_memory_gb
    # A sliding-window layer group's pool, when there is a global one too (None: what its
    # window needs for max_num_seqs requests, kv_cache.window_blocks; docs/sliding-window.md).
    window_pool_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget
    max_model_len: int | None = None  # defaults to the model's context length
    # Target wall time of one step while decodes or short requests wait: the prefill share
    # of the budget shrinks to fit it (None: fixed budget).
    target_step_ms: float | None = 400.0
    enable_prefix_caching: bool = True
    keep_aborted_prefix: bool = True  # a cancelled request's computed full blocks stay cached
    # AUTO: each victim recomputed or swapped, whichever costs less by measurement (on a CPU a
    # swap is a copy in host memory, ~25x cheaper than recomputing SmolLM2's tokens).
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    victim_policy: VictimPolicy = VictimPolicy.COST
    max_preemptions: int = 8  # per request; then it ends with finish_reason "preempted"
    swap_space_blocks: int = 0  # host blocks for swap preemption (0: as many as the pool)
    # Admission keeps this fraction of the pool free for running requests to grow into; it
    # rises after a preemption and decays back (SGLang's new_token_ratio, simplified).
    admission_headroom: float = 0.0
    # Admission also keeps room for every running request's next this-many tokens (up to
    # its max_tokens): a request admitted into room that the others need within a few steps
    # is only preempted again, its prefill thrown away (0: off).
    admission_lookahead: int = 8
    async_scheduling: bool = False
    # LoRA (docs/lora.md): most adapters resident (in the step's stacked slots) at once, most
    # loaded (in host memory; None: max_loras), and the highest rank one may have.
    max_loras: int = 8
    max_cpu_loras: int | None = None
    max_lora_rank: int = 64
    # Small decode steps drop a thread while neighbours take our CPUs (worker/cpu_share.py).
    adapt_threads: bool = True
    # "auto": the C kernel where it runs (CPU, AVX-512, a C compiler, head_dim 16 to 128),
    # else torch; "native" fails at start where it can't run; "torch" always torch. The two
    # give a position different bits, so an engine uses one for every step.
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    # With torch attention: decoding sequences keep a contiguous copy of their K/V (up to
    # twice the pool's memory; past that a step gathers), so a decode step reads it in place
    # instead of gathering their blocks from the pool every layer.
    decode_rows: bool = True
    # GEMM library of the linear layers: "auto" (on CPU, oneDNN for the large weights and
    # BLAS for the small ones; BLAS elsewhere), "blas" or "onednn". Each weight keeps one
    # library for every batch size, so a row's bits never depend on its batch.
    linear_backend: LinearBackend = LinearBackend.AUTO
    # GGUF weights in Q4_1/Q8_0 are also kept in their blocks, and a batch of up to this many
    # rows reads those (5-8.5 bits a weight instead of 32) through stopline's C kernel, which
    # gives the same bits as the float32 library path (0: always the library). Measured on
    # SmolLM2, 2 cores (Zen 5), with the 12-row kernel: its 30 layers and LM head at 64 / 128 /
    # 256 / 512 rows took 0.56 / 0.65 / 0.64 / 0.71x the library's time (bench/quant_time.py
    # --library), and a 64-row decode step 54.5 against 90.0 ms (bench/step_time.py 64
    # --compare-quant 128). 512 is the default step budget, so every step of a default engine
    # runs on the kernel. (On the Intel host before, the earlier tall kernel lost to the
    # library from about 96 rows.)
    quant_max_rows: int = 512
    # "exact" or "fast" (docs/numerics.md; the default is chosen there by measurement).
    numerics: Numerics = Numerics.EXACT
    # "int8": K and V as int8 with a scale per (kv head, token): about a quarter of the bytes
    # (more blocks for kv_cache_memory_gb), rounded, so fast numerics only.
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    # Seconds a request may wait for its grammar to compile (compiles are shared and cached;
    # one that runs past this is stopped and its grammar refused from then on).
    grammar_deadline: float = 5.0
    # Speculative decoding: drafts from the request's own prompt and output, verified in one
    # forward of k + 1 rows; lossless to the bit (docs/speculative.md).
    speculative: SpecMode = SpecMode.AUTO
    speculative_tokens: int = 8  # most drafts a request verifies in one step
    debug: bool = False  # audit after every step and poison freed blocks
    # The ownership audit on every Nth step while busy too (0: only in debug mode and through
    # the audit utility). A failure is logged and counted, and the core keeps serving.
    audit_every: int = 0
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        self.preemption_mode = PreemptionMode(self.preemption_mode)
        self.victim_policy = VictimPolicy(self.victim_policy)
        if os.environ.get("STOPLINE_DEBUG", "") not in ("", "0"):
            self.debug = True
        if self.max_preemptions < 0:
            raise ValueError(f"EngineConfig.max_preemptions must be >= 0, got {self.max_preemptions}")
        if self.audit_every < 0:
            raise ValueError(f"EngineConfig.audit_every must be >= 0, got {self.audit_every}")
        if self.quant_max_rows < 0:
            raise ValueError(f"EngineConfig.quant_max_rows must be >= 0, got {self.quant_max_rows}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.window_pool_blocks is not None and self.window_pool_blocks < 1:
            raise ValueError(f"EngineConfig.window_pool_blocks must be >= 1, got {self.window_pool_blocks}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"EngineConfig.linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, "
                             f"got {self.linear_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        self.linear_backend = LinearBackend(self.linear_backend)
        if self.speculative not in tuple(m.value for m in SpecMode):
            raise ValueError(f"EngineConfig.speculative must be one of off, on, auto, got {self.speculative!r}")
        self.speculative = SpecMode(self.speculative)
        if self.speculative_tokens < 1:
            raise ValueError(f"EngineConfig.speculative_tokens must be >= 1, got {self.speculative_tokens}")
        self.attention_backend = AttentionBackend(self.attention_backend)
        if self.numerics not in tuple(m.value for m in Numerics):
            raise ValueError(f"EngineConfig.numerics must be one of exact, fast, got {self.numerics!r}")
        self.numerics = Numerics(self.numerics)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = KVCacheDtype(self.kv_cache_dtype)
        if self.kv_cache_dtype is KVCacheDtype.INT8 and self.numerics is not Numerics.FAST:
            raise ValueError("--kv-cache-dtype int8 rounds the KV cache, so it needs --numerics fast "
                             f"(EngineConfig.kv_cache_dtype int8 with numerics {self.numerics.value})")
        if not 0 <= self.admission_headroom < 1:
            raise ValueError("EngineConfig.admission_headroom must be in [0, 1)")
        if not self.grammar_deadline > 0:
            raise ValueError(f"EngineConfig.grammar_deadline must be > 0 seconds, got {self.grammar_deadline}")
        if self.admission_lookahead < 0:
            raise ValueError(f"EngineConfig.admission_lookahead must be >= 0, got {self.admission_lookahead}")
