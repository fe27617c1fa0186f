"""LoRA adapters through `stopline serve --disagg` over real HTTP: `--lora` and the load and
unload endpoints reach both roles; an adapter request's greedy output equals one engine's
(alone, with n = 2, with echo and prompt logprobs), and base and adapter requests sharing a
prompt take no KV from each other; a load refused is refused on both; an unload with `abort`
ends the adapter's streams `abort` (source `unload`) wherever they are, with both roles'
audits clean and their references and blocks back to zero; a restarted role loads the
adapters again before it serves."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.lora_support import make_adapter
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(240)

ARGS = ("--served-model-name", "tiny", "--block-size", "4", "--num-blocks", "2048",
        "--max-num-batched-tokens", "64", "--max-lora-rank", "8")
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture(scope="module")
def adapters(tiny_long_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split_http_loras")
    return {n: make_adapter(tiny_long_model_dir, root / n, seed=s, std=0.3)
            for n, s in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def servers(tiny_long_model_dir, adapters):
    split = single = None
    try:
        split = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--disagg", "--reclaim-s", "2",
                              "--audit-every", "1", "--lora", f"a={adapters['a']}")
        single = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--in-process",
                               "--lora", f"a={adapters['a']}", f"b={adapters['b']}")
        split.wait_ready()
        single.wait_ready()
        yield split, single
    finally:
        for s in (split, single):
            if s is not None:
                s.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return srv.openai()


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base + path, json=body, headers=srv.headers, timeout=60)


def _complete(srv: ServerProcess, model: str, **kw):
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0.0) | kw
    return _client(srv).completions.create(model=model, extra_body={"ignore_eos": True}, **body)


def _role_metric(srv: ServerProcess, name: str, role: str, **labels: str) -> float:
    """The sum of `name` over the samples of `role` that carry these labels."""
    total = 0.0
    for k, v in srv.metrics().items():
        if k.startswith(name + "{") and f'replica="{role}"' in k and all(
                f'{lk}="{lv}"' in k for lk, lv in labels.items()):
            total += v
    return total


def _settles(srv: ServerProcess, name: str, role: str, want: float, timeout: float = 10.0,
             base: float = 0.0, **labels: str) -> None:
    """The role's metric reaches `want` (+ base): its snapshot comes with its next step."""
    deadline = time.monotonic() + timeout
    while (got := _role_metric(srv, name, role, **labels) - base) != want:
        assert time.monotonic() < deadline, (name, role, labels, got, want)
        time.sleep(0.05)


def _clean(srv: ServerProcess) -> None:
    """Both roles: no blocks, no adapter references, audits run and none failed."""
    deadline = time.monotonic() + 10
    for role in ("prefill", "decode"):
        while (_role_metric(srv, "stopline_kv_blocks_used", role)
               or _role_metric(srv, "stopline_lora_references", role)):
            assert time.monotonic() < deadline, srv.metrics()
            time.sleep(0.05)
        assert _role_metric(srv, "stopline_audits_total", role) > 0
        assert _role_metric(srv, "stopline_audit_failures_total", role) == 0


@pytest.mark.parametrize("case", [
    dict(),
    dict(n=2, temperature=0.8, seed=7),
    dict(max_tokens=0, echo=True, logprobs=2),
], ids=["greedy", "n2-seeded", "echo-logprobs"])
def test_adapter_output_through_the_split_equals_one_engine(servers, case):
    split, single = servers
    got, want = (_complete(s, "a", **case) for s in (split, single))
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    if case.get("logprobs"):
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert _role_metric(split, "stopline_lora_requests_total", "decode", adapter="a") > 0
    assert _role_metric(split, "stopline_lora_requests_total", "prefill", adapter="a") > 0  # it split


def test_a_shared_prompt_shares_no_kv_across_adapters(servers):
    """The same prompt under the adapter, the base, and the adapter again: each equals one
    engine's (the base would decode from the adapter's KV if the imported blocks were not
    keyed by adapter), and each imported prefix was found under its own adapter."""
    split, single = servers
    prompt = "a shared prompt for two models " * 5
    for model in ("a", "tiny", "a"):
        got, want = (_complete(s, model, prompt=prompt) for s in (split, single))
        assert got.choices[0].text == want.choices[0].text, model
        blocks = (got.usage.prompt_tokens - 1) // 4
        assert got.usage.prompt_tokens_details.cached_tokens == blocks * 4, model
    assert _complete(split, "a", prompt=prompt).choices[0].text != \
        _complete(split, "tiny", prompt=prompt).choices[0].text


def test_run_time_load_reaches_both_roles_and_a_refused_one_neither(servers, adapters, tmp_path,
                                                                    tiny_long_model_dir):
    split, single = servers
    r = _post(split, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path)})
    assert r.status_code == 400, r.text  # not an adapter directory: refused, nothing loaded
    deep = make_adapter(tiny_long_model_dir, tmp_path / "deep", seed=9, r=16)
    r = _post(split, "/v1/load_lora_adapter", {"lora_name": "deep", "lora_path": str(deep)})
    assert r.status_code == 400 and "rank 16" in r.json()["error"]["message"], r.text
    assert not any('adapter="deep"' in k or 'adapter="b"' in k for k in split.metrics())
    r = _post(split, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    assert _complete(split, "b").choices[0].text == _complete(single, "b").choices[0].text
    for role in ("prefill", "decode"):  # the roles' snapshots: taken as they step
        _settles(split, "stopline_lora_loads_total", role, 1, adapter="b")
    assert {"tiny", "a", "b"} <= {m.id for m in _client(split).models.list().data}
    r = _post(split, "/v1/unload_lora_adapter", {"lora_name": "b", "policy": "refuse"})
    assert r.status_code == 200, r.text
    assert _post(split, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2}).status_code == 404
    _complete(split, "tiny")
    for role in ("prefill", "decode"):
        _settles(split, "stopline_lora_unloads_total", role, 1, adapter="b")


def _stream(srv: ServerProcess, model: str, prompt: str, max_tokens: int, out: dict,
            started: threading.Event) -> None:
    try:
        for ch in _client(srv).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                  extra_body={"ignore_eos": True}):
            if ch.choices and ch.choices[0].text:
                out["tokens"] = out.get("tokens", 0) + 1
                started.set()
            if ch.choices and ch.choices[0].finish_reason:
                out["finish_reason"] = ch.choices[0].finish_reason
    except openai.APIError as exc:  # an error event: recorded, and the test fails on it
        out["finish_reason"] = f"error: {exc}"
    started.set()


def test_unload_abort_ends_streams_wherever_they_are(servers, adapters):
    """Two streams under c: one decoding, one whose long prompt has just gone in (prefilling,
    in transfer or decoding by the time the unload lands), and a base stream. `abort` ends
    both of c's `abort` with source unload; the base one runs to its end; both roles come
    back clean."""
    split, _ = servers
    r = _post(split, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200, r.text
    before = _role_metric(split, "stopline_aborts_total", "decode", source="unload")
    jobs = [("c", "once upon a time", 6000), ("tiny", "once upon a time", 300), ("c", "word " * 1500, 6000)]
    outs: list[dict] = [{} for _ in jobs]
    started = [threading.Event() for _ in jobs]
    threads = [threading.Thread(target=_stream, args=(split, *job, o, s), daemon=True)
               for job, o, s in zip(jobs, outs, started, strict=True)]
    for t, s in zip(threads[:2], started, strict=False):
        t.start()
        assert s.wait(60)
    threads[2].start()
    deadline = time.monotonic() + 30
    # The long prompt is in: decode holds c for it too (waiting for its KV, or past that).
    while _role_metric(split, "stopline_lora_references", "decode", adapter="c") < 2:
        assert time.monotonic() < deadline, split.metrics()
        time.sleep(0.01)
    r = _post(split, "/v1/unload_lora_adapter", {"lora_name": "c", "policy": "abort"})
    assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
    for t in threads:
        t.join(60)
    assert [o.get("finish_reason") for o in outs] == ["abort", "length", "abort"], outs
    _settles(split, "stopline_aborts_total", "decode", 2, base=before, source="unload")
    assert _post(split, "/v1/completions", {"model": "c", "prompt": "x", "max_tokens": 2}).status_code == 404
    _clean(split)


def test_refuse_and_wait_across_both_roles(servers, adapters):
    """While a stream holds w: `refuse` is 409 and w still serves; `wait` answers `unloading`,
    new requests for w get 404, the stream runs to its end, and then both roles drop w."""
    split, _ = servers
    r = _post(split, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(split, "w", "once upon a time " * 3, 1500, out, started),
                         daemon=True)
    t.start()
    assert started.wait(60)
    r = _post(split, "/v1/unload_lora_adapter", {"lora_name": "w", "policy": "refuse"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use", r.text
    r = _post(split, "/v1/unload_lora_adapter", {"lora_name": "w", "policy": "wait"})
    assert r.status_code == 200 and r.json()["status"] == "unloading", r.text
    assert _post(split, "/v1/completions", {"model": "w", "prompt": "x", "max_tokens": 2}).status_code == 404
    t.join(60)
    assert out.get("finish_reason") == "length", out
    _complete(split, "tiny")  # a step on each role: their snapshots say what they hold now
    for role in ("prefill", "decode"):
        _settles(split, "stopline_lora_unloads_total", role, 1, adapter="w")
    _clean(split)


def test_a_restarted_role_loads_the_adapters_before_it_serves(servers):
    split, single = servers
    want = _complete(single, "a").choices[0].text
    for role in ("prefill", "decode"):
        pid = _roles(split)[role]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (now := _roles(split)[role])["state"] != "healthy" or now["pid"] in (pid, None):
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        assert _complete(split, "a").choices[0].text == want, role
        _settles(split, "stopline_lora_loads_total", role, 1, adapter="a")
    _clean(split)


def _roles(srv: ServerProcess) -> dict[str, dict]:
    return {r["role"]: r for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"]}
