"""LoRA adapters over HTTP, with the engine core in its own process (load and unload are
messages to the core, handled between steps): `serve --lora`, /v1/models, `model: NAME`,
load/unload with vLLM's bodies, bad adapters as 400 that change nothing, the unload policies
(refuse 409, abort ends streams `abort`, wait lets them finish while new ones get 404), and the
per-adapter metrics."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from stopline import LLM
from tests.engine_support import greedy
from tests.lora_support import make_adapter
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lora_server(tiny_long_model_dir: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_loras")
    adapters = {n: make_adapter(tiny_long_model_dir, root / n, seed=s, std=0.3)
                for n, s in (("one", 1), ("two", 2), ("three", 3))}
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                        "--num-blocks", "256", "--lora", f"one={adapters['one']}", "--max-lora-rank", "8")
    try:
        srv.wait_ready()
        yield srv, adapters, root
    finally:
        srv.stop()


def _post(srv: ServerProcess, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(srv.base + path, json=body, headers=srv.headers, timeout=timeout)


def _complete(srv: ServerProcess, model: str, prompt: str = "The capital", max_tokens: int = 12) -> dict:
    r = _post(srv, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _models(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(srv.base + "/v1/models", headers=srv.headers, timeout=10)
    return {m["id"]: m for m in r.json()["data"]}


def test_serve_lora_lists_and_selects_adapters(lora_server, tiny_long_model_dir) -> None:
    srv, adapters, _ = lora_server
    models = _models(srv)
    assert models["one"]["parent"] == "tiny" and "parent" not in models["tiny"]
    out = _complete(srv, "one")
    assert out["model"] == "one"
    base = _complete(srv, "tiny")
    # The same tokens as the offline engine with the same adapter, and not the base model's.
    llm = LLM(model=str(tiny_long_model_dir), progress=False, num_blocks=64)
    assert llm.engine.residency.load_lora("one", str(adapters["one"]))["status"] == 200
    ids = llm.encode("The capital")
    want = llm.generate([ids], greedy(12, lora="one"))[0].outputs[0].text
    assert out["choices"][0]["text"] == want != base["choices"][0]["text"]
    r = _post(srv, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_errors_are_400_and_change_nothing(lora_server, tmp_path) -> None:
    srv, adapters, root = lora_server
    before = _models(srv)
    deep = make_adapter(Path(srv_model(srv)), tmp_path / "deep", seed=5, r=16)
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "deep", "lora_path": str(deep)})
    assert r.status_code == 400 and "rank 16" in r.json()["error"]["message"], r.text
    cfg = json.loads((adapters["two"] / "adapter_config.json").read_text())
    bad = tmp_path / "embed"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["embed_tokens"]}))
    (bad / "adapter_model.safetensors").write_bytes((adapters["two"] / "adapter_model.safetensors").read_bytes())
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "embed", "lora_path": str(bad)})
    assert r.status_code == 400 and "embed_tokens" in r.json()["error"]["message"], r.text
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert _models(srv) == before
    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404


def srv_model(srv: ServerProcess) -> str:
    args = srv.proc.args
    return args[args.index("--model") + 1]


def _stream(srv: ServerProcess, model: str, out: dict, started: threading.Event) -> None:
    """A long streaming completion; out gets its finish_reason and token count."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    n = 0
    with httpx.stream("POST", srv.base + "/v1/completions", json=body, headers=srv.headers, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            n += 1
            started.set()
            fr = ev["choices"][0].get("finish_reason") if ev.get("choices") else None
            if fr:
                out["finish_reason"] = fr
    out["events"] = n
    started.set()


def _background(srv: ServerProcess, model: str) -> tuple[threading.Thread, dict]:
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(srv, model, out, started), daemon=True)
    t.start()
    assert started.wait(60)
    return t, out


def test_unload_policies_over_http(lora_server) -> None:
    srv, adapters, _ = lora_server
    for name in ("two", "three"):
        r = _post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
        assert r.status_code == 200, r.text
    assert {"two", "three"} <= set(_models(srv))
    assert _complete(srv, "two")["model"] == "two"

    # refuse: 409 while in use, and it keeps serving
    t, out = _background(srv, "two")
    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "two", "policy": "refuse"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use", r.text
    # abort: the running stream ends `abort`, the adapter is gone at once
    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "two", "lora_int_id": 2, "policy": "abort"})
    assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
    t.join(60)
    assert out.get("finish_reason") == "abort", out
    assert "two" not in _models(srv)
    r = _post(srv, "/v1/completions", {"model": "two", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404

    # wait: new requests get 404 at once, the running one finishes
    t, out = _background(srv, "three")
    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "three", "policy": "wait"})
    assert r.status_code == 200 and r.json()["status"] == "unloading", r.text
    r = _post(srv, "/v1/completions", {"model": "three", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    t.join(120)
    assert out.get("finish_reason") == "length", out
    m = srv.wait_for(lambda m: m.get('stopline_lora_unloads_total{adapter="three"}', 0) == 1)
    assert m['stopline_lora_references{adapter="three"}'] == 0
    assert m['stopline_lora_unloads_total{adapter="two"}'] == 1
    assert m['stopline_lora_requests_total{adapter="two"}'] == 2
    assert m['stopline_lora_loads_total{adapter="one"}'] == 1
    srv.wait_idle()


def test_one_slot_serves_two_adapters_over_http(tiny_long_model_dir: Path, tmp_path_factory) -> None:
    """--max-loras 1 with two adapters loaded (--max-cpu-loras 2): concurrent requests of both
    and the base all finish with each one's text alone; the adapters take turns in the slot
    (evictions counted, one resident at a time)."""
    root = tmp_path_factory.mktemp("slot_loras")
    adapters = {n: make_adapter(tiny_long_model_dir, root / n, seed=s, std=0.3) for n, s in (("a", 4), ("b", 5))}
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                        "--num-blocks", "256", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "8",
                        "--lora", *(f"{n}={p}" for n, p in adapters.items()))
    try:
        srv.wait_ready()
        models = ["a", "b", "tiny", "b", "a", "tiny", "a", "b"]
        alone = {m: _complete(srv, m, max_tokens=24)["choices"][0]["text"] for m in ("a", "b", "tiny")}
        assert len(set(alone.values())) == 3
        got: dict[int, str] = {}

        def one(i: int) -> None:
            got[i] = _complete(srv, models[i], max_tokens=24)["choices"][0]["text"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == {i: alone[m] for i, m in enumerate(models)}
        srv.wait_idle(timeout=10)
        m = srv.metrics()
        assert m['stopline_lora_evictions_total{adapter="a"}'] + m['stopline_lora_evictions_total{adapter="b"}'] >= 1
        assert m['stopline_lora_resident{adapter="a"}'] + m['stopline_lora_resident{adapter="b"}'] == 1
    finally:
        srv.stop()
