"""LoRA adapters per request (docs/lora.md): exactness against HF + peft with the adapter merged,
for Llama and Qwen2; a mixed batch of three adapters and the base equal to each alone; bad
adapters refused with the problem named and nothing changed; the reference as a holder of the
one release; the prefix cache keyed by adapter; the unload policies."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stopline import LLM, AbortSource, FinishReason
from stopline.engine.core import EngineCore
from stopline.kv.block_pool import LedgerError
from stopline.request import InvalidRequest, SamplingParams, UnknownAdapter
from tests.engine_support import (
    MIN_MARGIN_TINY,
    assert_idle,
    collect,
    drive,
    greedy,
    hf_greedy,
    load_hf,
    random_prompts,
    sharp_tiny_dir,
)
from tests.lora_support import make_adapter, merged
from tests.tiny_families import make_family_dir

MAX_NEW = 16
LENGTHS = [5, 17, 33, 9, 40]
# Three adapters that differ in targets, rank and scaling (rsLoRA for the third).
ADAPTERS = {
    "qv": {"seed": 11, "r": 4, "targets": ("q_proj", "v_proj")},
    "all": {"seed": 12, "r": 8, "alpha": 4.0},
    "mlp": {"seed": 23, "r": 2, "targets": ("o_proj", "gate_proj", "down_proj"), "rslora": True},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, seed=5)


_made: dict[str, tuple[Path, dict[str, Path]]] = {}


def family(factory: pytest.TempPathFactory, name: str) -> tuple[Path, dict[str, Path]]:
    """The base model's directory and its three adapters' directories."""
    if name not in _made:
        d = sharp_tiny_dir(factory) if name == "llama" else make_family_dir(factory.mktemp(name), name)
        root = factory.mktemp(f"{name}_adapters")
        _made[name] = d, {a: make_adapter(d, root / a, **kw) for a, kw in ADAPTERS.items()}
    return _made[name]


def _engine(model: Path, adapters: dict[str, Path], **kw) -> LLM:
    kw.setdefault("num_blocks", 512)
    kw.setdefault("block_size", 4)
    llm = LLM(model=str(model), progress=False, debug=True, target_step_ms=None, **kw)
    for name, path in adapters.items():
        got = llm.engine.residency.load_lora(name, str(path))
        assert got["status"] == 200, got
    return llm


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    out = []
    for res in llm.generate(prompts, params):
        c = res.outputs[0]
        assert c.finish_reason is FinishReason.LENGTH, (c.finish_reason, c.stop_detail)
        out.append(c.token_ids)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_adapters_match_the_merged_oracle_alone_and_mixed(name: str, tmp_path_factory, prompts) -> None:
    base_dir, adapters = family(tmp_path_factory, name)
    refs = {None: hf_greedy(load_hf(base_dir), prompts, MAX_NEW)}
    for a, path in adapters.items():
        refs[a] = hf_greedy(merged(base_dir, path), prompts, MAX_NEW)
        refs[a].check_meaningful(MIN_MARGIN_TINY)
        assert refs[a].tokens != refs[None].tokens, f"adapter {a} changes nothing: the test would be blind"
    alone = _engine(base_dir, adapters, enable_prefix_caching=False)
    for a in refs:
        got = _run(alone, prompts, [greedy(MAX_NEW, lora=a)] * len(prompts))
        assert got == refs[a].tokens, f"{name} adapter {a}: differs from HF + peft merged"
    assert_idle(alone.engine)
    assert alone.engine.adapters.counts() == dict.fromkeys(adapters, 0)
    # Every prompt under every adapter and the base, in one run: chunked at 7 tokens a step in
    # a pool that preempts, with prefix caching on (the same prompts under four models).
    mixed = _engine(base_dir, adapters, num_blocks=24, max_num_batched_tokens=7, max_preemptions=1000)
    order = [(p, a) for a in refs for p in range(len(prompts))]
    order = order[1::2] + order[::2]  # neighbours of other adapters
    got = _run(mixed, [prompts[p] for p, _ in order], [greedy(MAX_NEW, lora=a) for _, a in order])
    for (p, a), toks in zip(order, got, strict=True):
        assert toks == refs[a].tokens[p], f"{name}: prompt {p} under {a} differs in the mixed batch"
    assert sum(mixed.engine.lifecycle.stats.preemptions.values()) > 0
    assert_idle(mixed.engine)


def test_the_torch_fallback_matches_the_merged_oracle(tmp_path_factory, prompts, monkeypatch) -> None:
    """Where the C kernels are off, the deltas run in torch (model/lora.py `_apply_torch`):
    greedy output still equals HF + peft merged."""
    import stopline.model.lora as lora

    base_dir, adapters = family(tmp_path_factory, "llama")
    want = hf_greedy(merged(base_dir, adapters["all"]), prompts, MAX_NEW)
    calls = []

    def torch_only(*args):
        calls.append(1)
        return original(*args)

    original = lora._apply_torch
    monkeypatch.setattr(lora, "_lib", lambda: None)
    monkeypatch.setattr(lora, "_apply_torch", torch_only)
    llm = _engine(base_dir, {"all": adapters["all"]}, enable_prefix_caching=False)
    assert _run(llm, prompts, [greedy(MAX_NEW, lora="all")] * len(prompts)) == want.tokens
    assert calls


def test_a_row_delta_does_not_depend_on_its_neighbours(tmp_path_factory) -> None:
    """The delta kernel alone: each row's bits are the same in batches of 1 to 300 rows."""
    from stopline.model.lora import LoraRows, Slots, apply

    base_dir, adapters = family(tmp_path_factory, "llama")
    eng = _engine(base_dir, adapters).engine
    slots = Slots(eng.model.config, 3)
    for i, a in enumerate(sorted(adapters)):
        slots.place(i, eng.model.adapters[a])
    g = torch.Generator().manual_seed(0)

    def rows(slot: list[int]) -> LoraRows:
        return LoraRows(torch.tensor(slot, dtype=torch.int32), slots)

    def every(n: int) -> LoraRows:
        return rows([i % 4 if i % 4 < 3 else -1 for i in range(n)])  # every fourth row: the base

    # (linear, in, out) of the tiny model
    for linear, k, width in (("qkv", 64, 128), ("o", 64, 64), ("gate_up", 64, 256), ("down", 128, 64)):
        x = torch.randn(300, k, generator=g)
        y = torch.randn(300, width, generator=g)
        full = apply(y.clone(), x, 0, linear, every(300))
        assert not torch.equal(full, y)
        for n in (1, 2, 3, 7, 16, 33, 64, 100, 257):
            assert torch.equal(apply(y[:n].clone(), x[:n], 0, linear, every(n)), full[:n]), (linear, n)
        # A row alone, whatever its place in the batch.
        for i in (1, 150, 299):
            alone = apply(y[i:i + 1].clone(), x[i:i + 1], 0, linear, rows([i % 4 if i % 4 < 3 else -1]))
            assert torch.equal(alone, full[i:i + 1]), (linear, i)


def _adapter_dir(tmp: Path, base: Path, **kw) -> Path:
    return make_adapter(base, tmp, seed=21, **kw)


def test_bad_adapters_are_refused_with_the_problem_named(tmp_path, tmp_path_factory) -> None:
    base_dir, adapters = family(tmp_path_factory, "llama")
    eng = _engine(base_dir, {"qv": adapters["qv"]}, max_lora_rank=8).engine
    before = dict(eng.model.adapters)

    def refused(name: str, path: Path | str, *words: str) -> None:
        got = eng.residency.load_lora(name, str(path))
        assert got["status"] == 400, got
        for w in words:
            assert w in got["message"], got
        assert eng.model.adapters == before and set(eng.adapters.refs) == set(before)

    # An adapter made for another base model (a larger hidden size) does not fit.
    other = tmp_path / "wide"
    from tests.tiny_model import make_tiny_llama_dir
    make_tiny_llama_dir(other, seed=1, hidden_size=96, intermediate_size=128)
    refused("wide", _adapter_dir(tmp_path / "wide_lora", other), "do not fit", "wrong base model")
    refused("deep", _adapter_dir(tmp_path / "rank", base_dir, r=16), "rank 16", "--max-lora-rank")
    head = _adapter_dir(tmp_path / "head", base_dir, targets=("q_proj", "lm_head"))
    refused("head", head, "lm_head", "not supported")
    refused("missing", tmp_path / "nowhere", "neither a PEFT adapter directory")
    cfg = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes((adapters["qv"] / "adapter_model.safetensors").read_bytes())
    refused("dora", bad, "DoRA")
    refused("qv", adapters["all"], "already loaded")
    # The request side: an unknown model is refused before anything is queued.
    with pytest.raises(UnknownAdapter, match="neither the base model nor a loaded adapter"):
        eng.add_request("x", [5, 6, 7], greedy(4, lora="nope"))
    assert not eng.has_unfinished()


def test_max_loras_caps_the_loaded_adapters(tmp_path_factory) -> None:
    base_dir, adapters = family(tmp_path_factory, "llama")
    eng = _engine(base_dir, {"qv": adapters["qv"]}, max_loras=1).engine
    got = eng.residency.load_lora("all", str(adapters["all"]))
    assert got["status"] == 400 and "--max-loras" in got["message"]
    assert eng.residency.unload_lora("qv", "refuse")["status"] == 200
    assert eng.residency.load_lora("all", str(adapters["all"]))["status"] == 200


def _core(tmp_path_factory, **kw) -> EngineCore:
    base_dir, adapters = family(tmp_path_factory, "llama")
    kw.setdefault("num_blocks", 512)
    return _engine(base_dir, adapters, block_size=4, **kw).engine


def test_each_exit_drops_the_reference_once(tmp_path_factory, prompts) -> None:
    """Finish, cancel while waiting and while running, deadline, preemption (which keeps it):
    after every step each adapter's count is its live requests; zero when idle."""
    eng = _core(tmp_path_factory, num_blocks=16, max_num_batched_tokens=8, max_preemptions=1000)
    seen: list[dict[str, int]] = []

    def check(engine: EngineCore, step: int) -> None:
        engine.audit()
        live = [r for r in engine.live_requests() if r.params.lora]
        want = {a: sum(r.params.lora == a for r in live) for a in engine.adapters.loaded}
        assert engine.adapters.counts() == want
        seen.append(want)
        if step == 2:
            engine.abort([inc for inc, fam in engine.families.by_incarnation.items()
                          if fam.request_id in ("c0", "c1")], AbortSource.CANCEL, time.monotonic())

    reqs = [(f"c{i}", prompts[i % len(prompts)], greedy(24, lora=a))
            for i, a in enumerate(["qv", "all", "mlp", "qv", "all", "mlp", "qv"])]
    reqs.append(("late", prompts[0], greedy(12, lora="mlp", deadline=1e-6)))
    reqs.append(("n3", prompts[1], SamplingParams(n=3, max_tokens=6, temperature=0.8, lora="all")))
    res = drive(eng, reqs, after_step=check)
    assert res[("c0", 0)].finish_reason is FinishReason.ABORT
    assert res[("late", 0)].finish_reason is FinishReason.TIMEOUT
    assert sum(eng.lifecycle.stats.preemptions.values()) > 0
    assert max(sum(s.values()) for s in seen) >= 5
    assert eng.adapters.counts() == {"qv": 0, "all": 0, "mlp": 0}
    assert eng.adapters.requests["all"] == 5  # two plus the three samples
    # A second release of an ended request changes nothing (a set, not a counter).
    any_req = next(iter(eng.adapters.refs))
    assert eng.adapters.counts()[any_req] == 0


def test_the_audit_catches_a_leaked_or_missing_reference(tmp_path_factory, prompts) -> None:
    eng = _core(tmp_path_factory)
    eng.add_request("a", prompts[0], greedy(4, lora="qv"))
    eng.step()
    req = eng.live_requests()[0]
    eng.adapters.refs["qv"].discard(req)
    eng.adapters.held.pop(req)
    with pytest.raises(LedgerError, match="holds no reference"):
        eng.audit()
    eng.adapters.refs["qv"].add(req)
    eng.adapters.held[req] = ("qv", eng.adapters.load_id["qv"])
    eng.audit()
    ghost = eng.live_requests()[0]
    eng.lifecycle.abort(ghost, AbortSource.CANCEL)
    eng.adapters.refs["qv"].add(ghost)  # a reference the release did not drop
    with pytest.raises(LedgerError, match="adapter references"):
        eng.audit()


def test_prefix_cache_never_crosses_adapters(tmp_path_factory) -> None:
    eng = _core(tmp_path_factory)
    prompt = random_prompts(1, [40], seed=9)[0]

    def cached(lora: str | None, rid: str, **kw) -> int:
        res = drive(eng, [(rid, prompt, greedy(4, lora=lora, **kw))])
        return res[(rid, 0)].usage.cached_tokens

    assert cached("qv", "first") == 0
    assert cached("qv", "again") > 0  # the same adapter reuses its prefix
    assert cached(None, "base") == 0  # not the base
    assert cached("all", "other") == 0  # nor another adapter
    # A cancelled request's kept prefix obeys the same rule.
    p2 = random_prompts(1, [40], seed=10)[0]
    eng.add_request("cut", p2, greedy(30, lora="mlp"))
    for _ in range(4):
        eng.step()
    eng.abort([next(iter(eng.families.by_incarnation))], AbortSource.CANCEL, time.monotonic())
    while eng.has_unfinished():
        eng.step()
    assert_idle(eng)
    prompt = p2
    assert cached("qv", "after_cut") == 0
    assert cached("mlp", "same_as_cut") > 0
    # Unloading and loading an adapter again under the same name starts a new key.
    path = eng.adapters.loaded["mlp"].path
    assert eng.residency.unload_lora("mlp", "refuse")["status"] == 200
    assert eng.residency.load_lora("mlp", path)["status"] == 200
    assert cached("mlp", "reloaded") == 0


def test_unload_policies(tmp_path_factory, prompts) -> None:
    eng = _core(tmp_path_factory)
    for i, a in enumerate(["qv", "qv", "all", "mlp"]):
        eng.add_request(f"u{i}", prompts[i], greedy(40, lora=a))
    eng.add_request("b", prompts[4], greedy(40))
    results: dict = {}
    for _ in range(3):
        collect(results, eng.step())
    # refuse: 409 while in use, nothing changes
    got = eng.residency.unload_lora("qv", "refuse")
    assert got["status"] == 409 and "in use by 2" in got["message"]
    assert eng.adapters.serves("qv")
    assert eng.residency.unload_lora("nope", "wait")["status"] == 404
    assert eng.residency.unload_lora("qv", "later")["status"] == 400
    # abort: its requests end abort with source `unload`, the others run on; one accepted
    # before the unload but not admitted yet ends with them
    eng.add_request("u_late", prompts[0], greedy(40, lora="qv"))
    got = eng.residency.unload_lora("qv", "abort")
    assert got["status"] == 200 and got["aborted"] == 2
    with pytest.raises(UnknownAdapter):
        eng.add_request("new", prompts[0], greedy(4, lora="qv"))
    collect(results, eng.step())
    assert "qv" not in eng.adapters.loaded
    for rid in ("u0", "u1", "u_late"):
        assert results[(rid, 0)].finish_reason is FinishReason.ABORT
        assert results[(rid, 0)].stop_detail == "unload"
    assert results.get(("u2", 0)) is not None and results[("u2", 0)].finish_reason is None
    # wait: new requests refused at once, running ones finish, then it goes
    got = eng.residency.unload_lora("all", "wait")
    assert got["status"] == 200 and got["pending"]
    with pytest.raises(InvalidRequest):
        eng.add_request("new2", prompts[0], greedy(4, lora="all"))
    assert "all" in eng.adapters.loaded
    while eng.has_unfinished():
        collect(results, eng.step())
        eng.audit()
    assert results[("u2", 0)].finish_reason is FinishReason.LENGTH
    assert len(results[("u2", 0)].token_ids) == 40
    assert "all" not in eng.adapters.loaded
    assert eng.adapters.unloads == {"qv": 1, "all": 1}
    # An idle unload with any policy is immediate.
    assert eng.residency.unload_lora("mlp", "wait") == {"status": 200, "message": "adapter 'mlp' unloaded", "pending": False}
    assert_idle(eng)


def test_a_gguf_lora_file_loads_as_its_peft_twin(tmp_path_factory, tmp_path, prompts) -> None:
    """llama.cpp's LoRA GGUF layout (Q/K rows of B permuted) gives the PEFT adapter's weights
    and tokens; a GGUF that is not a LoRA is refused."""
    from tests.lora_support import peft_to_gguf

    base_dir, adapters = family(tmp_path_factory, "llama")
    gguf_path = peft_to_gguf(adapters["all"], tmp_path / "all.gguf", q_heads=4, kv_heads=2)
    eng = _engine(base_dir, {"peft": adapters["all"]})
    assert eng.engine.residency.load_lora("gguf", str(gguf_path))["status"] == 200
    peft, gg = eng.engine.model.adapters["peft"], eng.engine.model.adapters["gguf"]
    assert peft.scale == gg.scale and peft.parts.keys() == gg.parts.keys()
    for k, target in peft.parts.items():
        assert torch.equal(target.a, gg.parts[k].a)
        for p, q in zip(target.parts, gg.parts[k].parts, strict=True):
            assert p.off == q.off and torch.equal(p.a, q.a) and torch.equal(p.bt, q.bt), k
    want = _run(eng, prompts, [greedy(MAX_NEW, lora="peft")] * len(prompts))
    assert _run(eng, prompts, [greedy(MAX_NEW, lora="gguf")] * len(prompts)) == want
    from tests.tiny_model import make_tiny_gguf
    model_gguf = make_tiny_gguf(base_dir, tmp_path / "model.gguf")
    got = eng.engine.residency.load_lora("model", str(model_gguf))
    assert got["status"] == 400 and "not a LoRA adapter" in got["message"], got


def test_adapters_outlive_a_weight_update_and_a_deep_sleep(tmp_path_factory, prompts) -> None:
    """The network is built again by commit_weights and by a wake from sleep level 2: the
    loaded adapters serve on, with the same tokens."""
    base_dir, adapters = family(tmp_path_factory, "llama")
    llm = _engine(base_dir, {"qv": adapters["qv"]})
    want = _run(llm, prompts[:2], [greedy(MAX_NEW, lora="qv")] * 2)
    eng = llm.engine
    eng.residency.stage_weights(str(base_dir))
    eng.residency.commit_weights()
    assert _run(llm, prompts[:2], [greedy(MAX_NEW, lora="qv")] * 2) == want
    eng.residency.sleep(2)
    eng.residency.wake_up()
    assert _run(llm, prompts[:2], [greedy(MAX_NEW, lora="qv")] * 2) == want
    assert_idle(eng)
