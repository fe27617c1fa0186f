"""LoRA in stacked slots (docs/lora.md): the C delta kernel (csrc/lora.c) against a float32
reference in its own order, bit for bit; batch invariance; adapter steps in the fused C
decoder with the Python loop's bits; the torch fallback; LRU residency under --max-loras."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.decoder_native import StepInterrupt
from stopline.model.kernels.native import try_kernels
from stopline.model.loaders.loader import load_model
from stopline.model.lora import LoraRows, Slots, apply
from stopline.request import AbortSource, FinishReason, SamplingParams
from tests.engine_support import drive, greedy
from tests.lora_support import make_adapter
from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir

# Four adapters: different targets (the qkv parts of different ranks), ranks and scales.
KINDS = {
    "qv": {"seed": 11, "r": 4, "targets": ("q_proj", "v_proj")},
    "all": {"seed": 12, "r": 8, "alpha": 4.0},
    "mlp": {"seed": 23, "r": 2, "targets": ("o_proj", "gate_proj", "down_proj"), "rslora": True},
    "kv": {"seed": 31, "r": 3, "targets": ("k_proj", "v_proj", "up_proj")},
}
PROMPTS = [[5, 17, 99, 23, 42, 7, 300, 12, 9, 81][: 3 + i] * (1 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def q4_lora(tmp_path_factory, stopline_cache_dir: Path):
    """A 3-layer tiny Llama as Q4_1 GGUF (every step on the fused C decoder) and its adapters."""
    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")
    hf = make_tiny_llama_dir(tmp_path_factory.mktemp("slots") / "tiny", seed=9, init_std=0.1,
                             vocab_size=384, layers=3)
    gguf = make_tiny_gguf(hf, tmp_path_factory.mktemp("slots_gguf") / "tiny.gguf", qtype="Q4_1")
    root = tmp_path_factory.mktemp("slots_adapters")
    adapters = {n: make_adapter(hf, root / n, **kw) for n, kw in KINDS.items()}
    return load_model(gguf, progress=False, cache_dir=stopline_cache_dir), adapters


def engine(q4_lora, **kw) -> EngineCore:
    loaded, adapters = q4_lora
    cfg = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, quant_max_rows=16, debug=True,
               target_step_ms=None, max_loras=4)
    cfg.update(kw)
    eng = EngineCore(loaded, EngineConfig(**cfg))
    for n, path in adapters.items():
        assert eng.residency.load_lora(n, str(path))["status"] == 200
    return eng


def run(eng: EngineCore, jobs: list[tuple[list[int], str | None]], after_step=None) -> dict:
    """Each job's 10 greedy tokens and top-2 logprobs (floats: any bit shows), by job index."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, lora=a) for _, a in jobs]
    res = drive(eng, [(f"j{i}", p, sp) for i, ((p, _), sp) in enumerate(zip(jobs, params, strict=True))],
                after_step=after_step)
    out = {}
    for i in range(len(jobs)):
        r = res[(f"j{i}", 0)]
        assert r.finish_reason is FinishReason.LENGTH
        out[i] = (r.token_ids, [(lp.logprob, lp.top) for lp in r.logprobs])
    return out


# ---- the kernel ---------------------------------------------------------------------------------

def slots_of(q4_lora) -> Slots:
    eng = engine(q4_lora)
    slots = Slots(eng.model.config, 5)
    for i, n in enumerate(["qv", "all", "mlp", "kv"]):
        slots.place(i if i < 2 else i + 1, eng.model.adapters[n])  # slot 2 stays empty
    return slots


def reference(x: torch.Tensor, y: torch.Tensor, slot: list[int], slots: Slots, li: int, linear: str) -> torch.Tensor:
    """The kernel's sums in float32, one IEEE op at a time, in its order (numpy, no FMA)."""
    ls = slots.linears[(li, linear)]
    out = y.numpy().copy()
    for i, s in enumerate(slot):
        parts = ls.parts[s].tolist() if s >= 0 else [[0, 0, 0]]
        rank = parts[-1][0]
        if rank == 0:
            continue
        a, bt, xi = ls.at[s].numpy(), ls.bt[s].numpy(), x[i].numpy()
        u = np.zeros(rank, np.float32)
        for k in range(xi.shape[0]):
            u = u + xi[k] * a[k, :rank]
        j0 = 0
        for j1, lo, hi in parts:
            if j1 > j0:
                acc = np.zeros(hi - lo, np.float32)
                for j in range(j0, j1):
                    acc = acc + u[j] * bt[j, lo:hi]
                out[i, lo:hi] = out[i, lo:hi] + slots.scale[s].numpy() * acc
            j0 = j1
    return torch.from_numpy(out)


def test_the_kernel_gives_the_float32_references_bits(q4_lora) -> None:
    slots = slots_of(q4_lora)
    g = torch.Generator().manual_seed(3)
    slot = [0, -1, 1, 3, 4, 2, 1, 0, 4, 3, -1, 1]  # slot 2: empty, as the base
    for (li, linear), ls in sorted(slots.linears.items()):
        k, n = ls.at.shape[1], ls.bt.shape[2]
        x, y = torch.randn(len(slot), k, generator=g), torch.randn(len(slot), n, generator=g)
        got = apply(y.clone(), x, li, linear, LoraRows(torch.tensor(slot, dtype=torch.int32), slots))
        assert torch.equal(got, reference(x, y, slot, slots, li, linear)), (li, linear)
        changed = (got != y).any(1).tolist()
        for i, s in enumerate(slot):  # base rows and the empty slot's are untouched
            if s in (-1, 2) or ls.parts[s, -1, 0] == 0:
                assert not changed[i]
        # And the delta is B A x: float64 agrees to float32 rounding.
        want = y.double().clone()
        for i, s in enumerate(slot):
            if s >= 0:
                want[i] += slots.scale[s].double() * (x[i].double() @ ls.at[s].double() @ ls.bt[s].double())
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_ranks_over_64_take_the_kernels_other_path_with_the_same_order(q4_lora) -> None:
    """q, k and v at rank 30 each: 90 ranks for qkv, past the 64 the kernel keeps in registers."""
    from stopline.model.lora import build

    eng = engine(q4_lora)
    c = eng.model.config
    g = torch.Generator().manual_seed(6)
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    pairs = {(0, m): (torch.randn(30, h, generator=g), torch.randn(o, 30, generator=g))
             for m, o in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))}
    slots = Slots(c, 3)
    slots.place(1, build("wide", "-", c, 64, 0.5, pairs))
    slots.place(2, eng.model.adapters["all"])
    slot = [1, -1, 2, 1, 1, 2, 0, 1, 1]  # slot 0: empty
    x, y = torch.randn(len(slot), h, generator=g), torch.randn(len(slot), q + 2 * kv, generator=g)
    got = apply(y.clone(), x, 0, "qkv", LoraRows(torch.tensor(slot, dtype=torch.int32), slots))
    assert slots.linears[(0, "qkv")].parts[1, -1, 0] == 90
    assert torch.equal(got, reference(x, y, slot, slots, 0, "qkv"))


def test_a_row_has_the_same_bits_alone_and_among_adapters_and_base_rows(q4_lora) -> None:
    slots = slots_of(q4_lora)
    g = torch.Generator().manual_seed(4)
    for (li, linear), ls in sorted(slots.linears.items()):
        k, n = ls.at.shape[1], ls.bt.shape[2]
        mixed = [1, -1, 0, 3, 4, -1, 1, 4] * 5  # the four adapters and base rows
        x, y = torch.randn(len(mixed), k, generator=g), torch.randn(len(mixed), n, generator=g)
        full = apply(y.clone(), x, li, linear, LoraRows(torch.tensor(mixed, dtype=torch.int32), slots))
        for i in (0, 3, 17, 39):
            alone = apply(y[i:i + 1].clone(), x[i:i + 1], li, linear,
                          LoraRows(torch.tensor([mixed[i]], dtype=torch.int32), slots))
            assert torch.equal(alone, full[i:i + 1]), (li, linear, i)


def test_the_torch_fallback_adds_the_same_delta(q4_lora, monkeypatch) -> None:
    """Where the C kernels are off, torch runs the same sums per slot (not the same bits: one
    host uses one of the two)."""
    import stopline.model.lora as lora

    slots = slots_of(q4_lora)
    g = torch.Generator().manual_seed(5)
    slot = torch.tensor([0, -1, 1, 3, 4, 2, 1], dtype=torch.int32)
    for (li, linear), ls in sorted(slots.linears.items()):
        x, y = torch.randn(7, ls.at.shape[1], generator=g), torch.randn(7, ls.bt.shape[2], generator=g)
        c = apply(y.clone(), x, li, linear, LoraRows(slot, slots))
        monkeypatch.setattr(lora, "_lib", lambda: None)
        t = apply(y.clone(), x, li, linear, LoraRows(slot, slots))
        monkeypatch.undo()
        assert torch.allclose(c, t, rtol=1e-5, atol=1e-6), (li, linear)
        assert torch.equal(c[1], y[1]) and torch.equal(t[1], y[1]) and torch.equal(t[5], y[5])


# ---- the fused decoder --------------------------------------------------------------------------

def test_adapter_steps_run_in_the_c_decoder_with_the_python_loops_bits(q4_lora) -> None:
    """A mixed batch (four adapters and the base): decode steps run in the C loop, and every
    token and logprob equals the Python layer loop's, which calls the same kernel; a row's
    result equals its run alone (batch invariance)."""
    jobs = [(p, a) for p, a in zip(PROMPTS, ["qv", None, "all", "mlp", "kv", "qv"], strict=True)]
    c_eng = engine(q4_lora)
    with_c = run(c_eng, jobs)
    assert c_eng.model.decoder.lora_steps >= 9  # the decodes
    py_eng = engine(q4_lora)
    py_eng.model.c_layers = False
    assert run(py_eng, jobs) == with_c
    assert py_eng.model.decoder.lora_steps == 0
    for i in (0, 2, 4):
        assert run(engine(q4_lora), [jobs[i]])[0] == with_c[i], jobs[i][1]
    # The adapters change the tokens: the comparison is not blind.
    assert run(engine(q4_lora), [(jobs[2][0], None)])[0][0] != with_c[2][0]


def test_an_abort_stops_an_adapter_step_in_the_c_loop(q4_lora) -> None:
    eng = engine(q4_lora)
    xi = eng.add_request("x", PROMPTS[3], greedy(8, lora="all"))
    yi = eng.add_request("y", PROMPTS[2], greedy(8, lora="mlp"))
    eng.step()
    run_c = eng.model.decoder.run

    def abort_then_run(x, inp, kv, interrupt):
        eng.abort([xi, yi], AbortSource.CANCEL, time.monotonic())
        assert inp.lora is not None and isinstance(interrupt, StepInterrupt) and interrupt.flag.item() == 1
        return run_c(x, inp, kv, interrupt)

    eng.model.decoder.run = abort_then_run
    done = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.finish_reason for o in eng.step() if o.finished}
    assert eng.interrupted_steps == 1
    assert done == {"x": FinishReason.ABORT, "y": FinishReason.ABORT}


# ---- residency ----------------------------------------------------------------------------------

def test_two_slots_serve_four_adapters_lru_without_deadlock(q4_lora) -> None:
    """--max-loras 2 with four adapters loaded: requests of a non-resident adapter wait while
    base rows and resident adapters run; unused adapters are evicted least recently used first,
    never one a live request holds (the audit checks after every step); all finish with each
    one's tokens alone."""
    order = ["qv", "all", None, "mlp", "kv", None, "all", "qv", "kv", "mlp", None, "qv"]
    jobs = [(PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(order)]
    alone = {}
    for i, job in enumerate(jobs):
        alone[i] = run(engine(q4_lora), [job])[0]
    seen = {"waited": 0, "base_ran_meanwhile": 0, "most": 0}

    def check(eng: EngineCore, step: int) -> None:
        names = [n for n in eng.adapters.slots.names if n is not None]
        seen["most"] = max(seen["most"], len(names))
        waiting = [r for r in eng.queues.waiting if r.params.lora and not eng.adapters.is_resident(r.params.lora)]
        if waiting:
            seen["waited"] += 1
            if any(r.params.lora is None for r in eng.queues.running):
                seen["base_ran_meanwhile"] += 1

    eng = engine(q4_lora, max_loras=2, max_cpu_loras=4, num_blocks=48, max_preemptions=1000)
    assert len(eng.adapters.loaded) == 4
    got = run(eng, jobs, after_step=check)
    assert got == alone
    assert seen["most"] == 2 and seen["waited"] > 0 and seen["base_ran_meanwhile"] > 0
    assert sum(eng.adapters.evictions.values()) >= 2
    assert eng.adapters.counts() == dict.fromkeys(KINDS, 0)
    # The snapshot (metrics, console) carries each adapter's evictions and residency.
    from stopline.engine.snapshot import take_snapshot

    snap = take_snapshot(eng).loras
    assert {n: v[5] for n, v in snap.items()} == dict(eng.adapters.evictions) | {
        n: 0 for n in KINDS if n not in eng.adapters.evictions}
    assert sum(v[6] for v in snap.values()) == 2


def test_a_held_adapter_is_never_evicted(q4_lora) -> None:
    eng = engine(q4_lora, max_loras=1, max_cpu_loras=4)
    eng.add_request("a", PROMPTS[0], greedy(30, lora="qv"))
    eng.add_request("b", PROMPTS[1], greedy(4, lora="all"))
    eng.add_request("base", PROMPTS[2], greedy(4))
    results = {}
    for _ in range(6):
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o.finish_reason
        eng.audit()
        assert eng.adapters.slots.names == ["qv"]  # "a" holds it: "all" waits
    assert results == {"base": FinishReason.LENGTH}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o.finish_reason
    assert results == {"base": FinishReason.LENGTH, "a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert eng.adapters.evictions == {"qv": 1}
    assert eng.adapters.slots.names == ["all"]
    # An unload frees the slot at once.
    assert eng.residency.unload_lora("all", "wait")["status"] == 200
    assert eng.adapters.slots.names == [None]


def test_max_cpu_loras_caps_the_loaded_adapters_and_is_at_least_max_loras(q4_lora) -> None:
    eng = engine(q4_lora, max_loras=1, max_cpu_loras=4)
    got = eng.residency.load_lora("more", str(q4_lora[1]["qv"]))
    assert got["status"] == 400 and "--max-cpu-loras" in got["message"]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
