"""LoRA adapters through the prefill/decode split, the two roles in one process stepped by
hand over a real loopback link: a request is prefilled under its adapter, its KV shipped
with the adapter's name and load id, and decoded under the same adapter (greedy output equal
to one engine's); the imported blocks are keyed by adapter on the decode side, so no prefix
crosses adapters; a transfer whose adapter load does not match the decode side's is refused
with an error, never decoded; an unload with `abort` ends the request wherever it is on
either role, once, with source `unload`; each role's references are zero when idle."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import FinishReason
from tests.disagg_support import BLOCK, config, make_pair
from tests.engine_support import drive, greedy, random_prompts
from tests.lora_support import make_adapter


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split_loras")
    return {n: make_adapter(tiny_model_dir, root / n, seed=s, std=0.3) for n, s in (("a", 1), ("b", 2))}


@pytest.fixture
def pair(loaded, adapters):
    pr = make_pair(loaded)
    for i, (name, path) in enumerate(sorted(adapters.items()), 1):
        pr.load_lora(name, str(path), i)
    yield pr
    pr.close()


def _single(loaded, adapters, reqs):
    eng = EngineCore(loaded, config())
    for name, path in sorted(adapters.items()):
        assert eng.residency.load_lora(name, str(path))["status"] == 200
    return drive(eng, reqs)


def _until_sent(pair) -> None:
    for _ in range(100):
        if len(pair.p.role.sending):
            return
        pair.step_p()
    raise AssertionError("the prefill side never shipped the KV")


def _refs(core: EngineCore) -> dict[str, int]:
    return {n: c for n, c in core.adapters.counts().items() if c}


def test_adapter_requests_through_the_split_equal_one_engine(loaded, adapters, pair):
    """The same prompt under a, b and the base, one after another (the decode side then holds
    all three prompts' imported blocks): each equals one engine's output, and each imported its
    own blocks under its own adapter (three chains of hashes, none shared)."""
    prompt = random_prompts(1, [26], seed=5)[0]
    reqs = [(f"r{lora}", prompt, greedy(8, lora=lora)) for lora in ("a", None, "b")]
    want = _single(loaded, adapters, reqs)
    assert len({tuple(r.token_ids) for r in want.values()}) == 3  # the adapters change the output
    n = (len(prompt) - 1) // BLOCK
    for rid, p, params in reqs:
        pair.add(rid, p, params)
        pair.settle()
    pair.assert_idle()
    assert pair.d.role.imported_blocks == 3 * n
    for key, r in want.items():
        assert pair.out[key].token_ids == r.token_ids, key
        # The imported prefix is found under the request's own adapter (all n blocks).
        assert pair.out[key].usage.cached_tokens == n * BLOCK, key
    assert len(pair.d.pool.hash_to_block) >= 3 * n  # one chain per adapter, none merged
    assert not _refs(pair.p) and not _refs(pair.d)
    assert pair.p.adapters.requests["a"] == pair.d.adapters.requests["a"] == 1


def test_a_mixed_batch_through_the_split_equals_one_engine(loaded, adapters, pair):
    prompts = random_prompts(6, [9, 17, 26, 13, 21, 30], seed=8)
    loras = ["a", "b", None, "a", "b", None]
    reqs = [(f"m{i}", p, greedy(6, lora=lo)) for i, (p, lo) in enumerate(zip(prompts, loras, strict=True))]
    want = _single(loaded, adapters, reqs)
    for rid, p, params in reqs:
        pair.add(rid, p, params)
    pair.settle()
    pair.assert_idle()
    for key, r in want.items():
        assert pair.out[key].token_ids == r.token_ids, key


def test_a_transfer_of_another_load_is_refused_not_decoded(loaded, adapters):
    """Prefill and decode hold different loads of `a` (ids 1 and 2): the KV the prefill side
    ships names load 1, decode refuses it and ends the request with an error naming both; the
    prefill side gets the refusal; nothing is held on either side."""
    pr = make_pair(loaded)
    try:
        pr.load_lora("a", str(adapters["a"]), 1, decode_id=2)
        pr.add("x", random_prompts(1, [17], seed=2)[0], greedy(4, lora="a"))
        pr.settle()
        pr.assert_idle()
        out = pr.out[("x", 0)]
        assert out.finish_reason is FinishReason.ERROR and out.token_ids == []
        assert "adapter 'a' (load 1)" in out.stop_detail and "adapter 'a' (load 2)" in out.stop_detail
        assert pr.d.role.imported_blocks == 0
        assert pr.p_out[-1].finish_reason is FinishReason.ERROR
        assert "refused" in pr.p_out[-1].stop_detail
        assert not _refs(pr.p) and not _refs(pr.d)
    finally:
        pr.close()


@pytest.mark.parametrize("where", ["prefilling", "in transfer", "decoding"])
def test_unload_abort_ends_the_request_wherever_it_is(pair, where):
    """`abort` on both roles ends the request with source `unload`, exactly once, whether it
    is still prefilling, its KV shipped but not taken, or decoding; both roles let go."""
    prompt = list(range(5, 45))  # 40 tokens: 5 chunks of 8 on the prefill side
    pair.add("u", prompt, greedy(200, lora="a"))
    pair.add("base", prompt, greedy(6))
    if where == "prefilling":
        pair.step_p()
        pair.step_d()
        assert pair.p.live_requests() and not len(pair.p.role.sending)
    elif where == "in transfer":
        _until_sent(pair)
        pair.step_d()
        assert len(pair.d.role.receiving) or len(pair.p.role.sending)
    else:
        pair.settle(until=lambda pr: len(pr.out.get(("u", 0)).token_ids) > 2
                    if ("u", 0) in pr.out else False)
    assert _refs(pair.d) == {"a": 1}
    pair.unload_lora("a", "abort")
    pair.settle()
    pair.assert_idle()
    out = pair.out[("u", 0)]
    assert out.finish_reason is FinishReason.ABORT and out.stop_detail == "unload"
    assert len([d for d in out.deltas if d.finished]) == 1
    assert pair.out[("base", 0)].finish_reason is FinishReason.LENGTH
    assert "a" not in pair.p.adapters.loaded and "a" not in pair.d.adapters.loaded
    assert not _refs(pair.p) and not _refs(pair.d)


class _FakeRole:
    """A role's core as the front end sees it: utility calls recorded, answers scripted."""

    def __init__(self, answers: dict[str, dict]) -> None:
        self.calls: list[tuple] = []
        self.answers = answers

    async def utility(self, method, *args):
        self.calls.append((method.value, *args))
        return self.answers.get(method.value, {"status": 200, "message": "ok"})


def _front(prefill: dict, decode: dict):
    from stopline.disagg.frontend import DisaggCores

    backend = DisaggCores(None, config())
    shutil.rmtree(backend._dir)  # nothing is started: no link
    backend.cores = {"prefill": _FakeRole(prefill), "decode": _FakeRole(decode)}
    backend.state = {"prefill": "healthy", "decode": "healthy"}
    return backend


def test_front_end_loads_both_roles_with_one_id_and_undoes_a_one_sided_load():
    from stopline.engine.messages import Utility

    ok = _front({}, {})
    got = [asyncio.run(ok.utility(Utility.LOAD_LORA, n, f"/p/{n}")) for n in ("x", "y")]
    assert [g["status"] for g in got] == [200, 200]
    for role in ok.cores.values():  # the same order, the same ids
        assert role.calls == [("load_lora", "x", "/p/x", 1), ("load_lora", "y", "/p/y", 2)]
    assert ok.loras == {"x": ("/p/x", 1), "y": ("/p/y", 2)}

    bad = {"load_lora": {"status": 400, "message": "adapter 'x': rank 16 is over the limit"}}
    front = _front({}, bad)
    got = asyncio.run(front.utility(Utility.LOAD_LORA, "x", "/p/x"))
    assert got == bad["load_lora"]
    assert front.cores["prefill"].calls == [("load_lora", "x", "/p/x", 1), ("unload_lora", "x", "abort")]
    assert front.cores["decode"].calls == [("load_lora", "x", "/p/x", 1)]
    assert front.loras == {}


def test_front_end_refuse_asks_decode_first():
    from stopline.engine.messages import Utility

    busy = _front({}, {"unload_lora": {"status": 409, "message": "in use"}})
    busy.loras["x"] = ("/p/x", 1)
    assert asyncio.run(busy.utility(Utility.UNLOAD_LORA, "x", "refuse"))["status"] == 409
    assert busy.cores["prefill"].calls == [] and busy.loras == {"x": ("/p/x", 1)}  # nothing changed

    free = _front({}, {})
    free.loras["x"] = ("/p/x", 1)
    assert asyncio.run(free.utility(Utility.UNLOAD_LORA, "x", "refuse"))["status"] == 200
    # Decode held none: any copy left on prefill is of a request decode already ended.
    assert free.cores["prefill"].calls == [("unload_lora", "x", "abort")] and free.loras == {}


def test_front_end_refuses_a_load_while_a_role_is_down():
    from stopline.engine.messages import Utility

    front = _front({}, {})
    front.state["prefill"], front.errors["prefill"] = "restarting", "killed"
    for call in ((Utility.LOAD_LORA, "x", "/p/x"), (Utility.UNLOAD_LORA, "x", "abort")):
        got = asyncio.run(front.utility(*call))
        assert got["status"] == 503 and "prefill engine is restarting" in got["message"], got
    assert front.cores["decode"].calls == []
