"""Offline throughput: stopline's LLM.generate next to HF transformers' generate, same run.

Four measurements on the same chat prompts, greedy, every request generating exactly
`max_tokens` tokens (EOS ignored):

  stopline, 1 stream      LLM.generate on one prompt
  HF,       1 stream      model.generate on the same prompt
  stopline, N streams     LLM.generate on N prompts at once (continuous batching)
  HF,       N streams     model.generate on the N prompts as one left-padded batch

Throughput is output tokens / wall time of the whole call (prefill included), the figure a
user of an offline API sees. Ratios are taken between numbers measured in the same process
minutes apart, so a machine that is busier or slower than usual moves both sides.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.config import EngineConfig
from stopline.engine.llm import LLM
from stopline.model.loaders.loader import LoadedModel, export_hf_dir, load_model
from stopline.request import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in simple terms.", "List three prime numbers.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "How do airplanes fly?",
    "What is the boiling point of water?", "Tell me a joke about cats.",
    "Summarize the plot of Romeo and Juliet.", "What causes earthquakes?",
    "How does a computer store numbers?", "Describe a sunset to someone who cannot see.",
    "What is machine learning?", "Write a short poem about autumn.",
    "How do vaccines work?", "What are the planets of the solar system?",
    "Give three tips for learning a new language.", "What is the Pythagorean theorem?",
    "Why do leaves change color in the fall?", "Explain what a black hole is.",
    "How do I make a cup of tea?", "What is the difference between weather and climate?",
    "Write a limerick about a dog.", "What is DNA?", "How does the internet work?",
    "Name five animals that live in the ocean.", "What is inflation in economics?",
    "Explain recursion to a child.", "What is the tallest mountain on Earth?",
    "Write a two-sentence story about a robot.",
]

# Figures from the issue (same model, this kind of 2-core machine), for context in the output.
REFERENCE = {
    "target_stopline_tok_s": {"1": 22.0, "32": 150.0},
    "vllm_cpu_0.32_fp32_tok_s": {"1": 22.0, "32": "127-147"},
    "llama_cpp_q4_1_tok_s": {"1": 93.0, "32": 151.0},
    "hf_generate_tok_s": {"1": 9.0},
}


def chat_prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    """n chat-templated prompts (token ids); beyond the question list they get a number, so
    that no two requests share more than the chat template's prefix."""
    tok = loaded.tokenizer
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q = f"({i}) {q}"
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


class _HFProgress:
    """A transformers streamer that advances the progress bar by one token per sequence per
    step (its first call carries the prompt, which is not output)."""

    def __init__(self, bar: tqdm, batch: int) -> None:
        self.bar = bar
        self.batch = batch
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.bar.update(self.batch)

    def end(self) -> None:
        pass


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_stopline(llm: LLM, prompts: list[list[int]], max_tokens: int, bar: tqdm) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res, secs = _timed(lambda: llm.generate(prompts, params,
                                            on_output=lambda o: bar.update(len(o.new_token_ids))))
    tokens = [r.outputs[0].token_ids for r in res]
    n_out = sum(len(t) for t in tokens)
    return {"streams": len(prompts), "output_tokens": n_out, "seconds": round(secs, 3),
            "tok_s": round(n_out / secs, 2), "tokens": tokens}


@torch.inference_mode()
def run_hf(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int, bar: tqdm) -> dict[str, Any]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out, secs = _timed(lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=max_tokens,
        do_sample=False, pad_token_id=pad_id, streamer=_HFProgress(bar, len(prompts))))
    tokens = out[:, width:].tolist()
    n_out = sum(len(t) for t in tokens)
    return {"streams": len(prompts), "output_tokens": n_out, "seconds": round(secs, 3),
            "tok_s": round(n_out / secs, 2), "tokens": tokens}


@torch.inference_mode()
def run_hf_cb(model: Any, prompts: list[list[int]], max_tokens: int, bar: tqdm) -> dict[str, Any]:
    """HF transformers' continuous batching (`generate_batch`, paged attention), greedy."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0, block_size=16, max_batch_tokens=512,
                           num_blocks=-(-len(prompts) * (max(len(p) for p in prompts) + max_tokens) // 16) + 16)
    out, secs = _timed(lambda: model.generate_batch(inputs=prompts, generation_config=gen,
                                                    progress_bar=False))
    bar.update(len(prompts) * max_tokens)
    tokens = [list(out[k].generated_tokens)[:max_tokens] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    n_out = sum(len(t) for t in tokens)
    return {"streams": len(prompts), "output_tokens": n_out, "seconds": round(secs, 3),
            "tok_s": round(n_out / secs, 2), "tokens": tokens}


def _load_hf(loaded: LoadedModel, hf_dir: Path | None, attn: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    if hf_dir is None or not (hf_dir / "config.json").is_file():
        import tempfile

        hf_dir = Path(tempfile.mkdtemp(prefix="stopline-hf-"))
        export_hf_dir(loaded, hf_dir)
    extra = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **extra)
    model.eval()
    # EOS is ignored on both sides: every request generates exactly max_tokens tokens.
    model.generation_config.eos_token_id = None
    return model


def run(model: str | None, config: EngineConfig, *, streams: int = 32, max_tokens: int = 256,
        hf: bool = True, hf_dir: Path | None = None, threads: int | None = None,
        progress: bool = True, hf_cb: bool = False) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    # Other work on the machine slows both sides; the load average says how much there was.
    load_before = os.getloadavg()
    loaded, load_s = _timed(lambda: load_model(model, progress=progress))
    llm = LLM(model=loaded, config=config, progress=progress)  # type: ignore[arg-type]
    hf_model = _load_hf(loaded, hf_dir) if hf else None
    # Continuous batching needs the paged attention implementation: a second instance.
    hf_cb_model = _load_hf(loaded, hf_dir, attn="paged|sdpa") if hf_cb else None
    prompts = chat_prompts(loaded, streams)
    pad_id = loaded.config.eos_token_ids[0]

    # Warm-up (first-call allocations, lazy inits) on both sides, not measured.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm)
    if hf_model is not None:
        with tqdm(disable=True) as null:
            run_hf(hf_model, prompts[:2], 4, pad_id, null)
    if hf_cb_model is not None:
        with tqdm(disable=True) as null:
            run_hf_cb(hf_cb_model, prompts[:2], 4, null)

    phases: list[tuple[str, str, list[list[int]]]] = [("stopline", "1", prompts[:1])]
    if hf_model is not None:
        phases.append(("hf", "1", prompts[:1]))
    phases.append(("stopline", str(streams), prompts))
    if hf_model is not None:
        phases.append(("hf", str(streams), prompts))
    if hf_cb_model is not None:
        phases.append(("hf_cb", str(streams), prompts))
    total = sum(len(p) * max_tokens for _, _, p in phases)
    results: dict[str, dict[str, Any]] = {"stopline": {}, "hf": {}, "hf_cb": {}}
    with tqdm(total=total, unit="tok", desc="bench offline", disable=not progress,
              file=sys.stderr) as bar:
        for engine, key, ps in phases:
            bar.set_postfix_str(f"{engine}, {len(ps)} stream{'s' if len(ps) > 1 else ''}")
            if engine == "stopline":
                results[engine][key] = run_stopline(llm, ps, max_tokens, bar)
            elif engine == "hf_cb":
                results[engine][key] = run_hf_cb(hf_cb_model, ps, max_tokens, bar)
            else:
                results[engine][key] = run_hf(hf_model, ps, max_tokens, pad_id, bar)

    # Greedy on the same weights: how many sequences came out identical (HF's batched run
    # pads and reorders its sums, so a near-tie can go the other way there).
    agree: dict[str, str] = {}
    ratios: dict[str, float] = {}
    for key, ours in results["stopline"].items():
        for side, suffix in (("hf", ""), ("hf_cb", "_cb")):
            theirs = results[side].get(key)
            if theirs is None:
                continue
            same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True))
            agree[key + suffix] = f"{same}/{len(ours['tokens'])}"
            ratios[key + suffix] = round(ours["tok_s"] / theirs["tok_s"], 2)
    for side in results.values():
        for r in side.values():
            del r["tokens"]
    return {
        "benchmark": "offline",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **machine.stamp(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "model": loaded.source,
        "model_load_seconds": round(load_s, 2),
        "weights_from_cache": loaded.from_cache,
        "max_tokens": max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "engine_config": {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(config).items()},
        "results": results,
        "speedup_vs_hf": ratios,
        "greedy_sequences_equal_to_hf": agree,
        "reference": REFERENCE,
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"offline throughput, {result['max_tokens']} new tokens per request, EOS ignored "
             f"({result['machine']['summary']}, torch threads {result['torch_threads']})"]
    for key in result["results"]["stopline"]:
        ours = result["results"]["stopline"][key]
        line = f"  {key:>3} stream{'s' if key != '1' else ' '}: stopline {ours['tok_s']:8.1f} tok/s"
        theirs = result["results"]["hf"].get(key)
        if theirs is not None:
            line += (f"   HF generate {theirs['tok_s']:8.1f} tok/s   ratio "
                     f"{result['speedup_vs_hf'][key]:.2f}x   greedy equal "
                     f"{result['greedy_sequences_equal_to_hf'][key]}")
        cb = result["results"].get("hf_cb", {}).get(key)
        if cb is not None:
            line += (f"   HF continuous batching {cb['tok_s']:8.1f} tok/s   ratio "
                     f"{result['speedup_vs_hf'][key + '_cb']:.2f}x   greedy equal "
                     f"{result['greedy_sequences_equal_to_hf'][key + '_cb']}")
        lines.append(line)
    return "\n".join(lines)


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)



def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="concurrent prompts in the batched run")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per request (EOS ignored)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    p.add_argument("--hf-cb", action="store_true",
                   help="also time HF transformers' continuous batching (generate_batch) on the N streams")
    p.add_argument("--hf-dir", default=None,
                   help="HF export of the model for transformers (default: exported to a temp dir)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench-results/offline.json")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    result = run(args.model, engine_config(args), streams=args.streams, max_tokens=args.max_tokens,
                 hf=not args.no_hf, hf_dir=Path(args.hf_dir) if args.hf_dir else None,
                 threads=args.threads, hf_cb=args.hf_cb)
    result["command"] = "stopline bench offline " + " ".join(sys.argv[3:])
    write(result, Path(args.out))
    print(summary(result))
    print(f"results: {args.out}")
    return 0
