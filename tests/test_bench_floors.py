"""`stopline bench floors` runs on the tiny model and its numbers are positive and consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stopline.cli import main
from stopline.model.kernels.int8_linear import has_vnni
from stopline.model.kernels.native import has_bf16, try_kernels
from tests.bench_support import assert_stamped
from tests.engine_support import sharp_tiny_dir


def test_floors_on_tiny_model(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys) -> None:
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "floors.json"
    fast = has_bf16() and try_kernels() is not None
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat and looked at the dog\n\nfour five six seven eight nine ten\n")
    rc = main(["bench", "floors", "--model", str(model), "--streams", "1", "4", "--buffer-mib", "64",
               "--reps", "2", "--warm", "2", "--steps", "4", "--num-blocks", "256", "--out", str(out),
               "--prefill-tokens", "40", "--prefill-reps", "1", "--llama-bench", str(tmp_path / "none"),
               "--texts", str(texts)]
              + (["--accuracy", "--modes", "exact", "fast", "fast-int8"] if fast else ["--modes", "exact"]))
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["read_bandwidth_gbs"] > 0 and all(v > 0 for v in r["gemm_gflops_32_rows"].values())
    assert_stamped(r)
    # the int8 rates (torch's, and the fast mode's kernel for block weights where it runs)
    assert "torch int8" in r["gemm_gflops_32_rows"]
    assert ("int8 kernel" in r["gemm_gflops_32_rows"]) == (has_vnni() and try_kernels() is not None)
    assert {(s["streams"], s["mode"]) for s in r["steps"]} >= {(1, "exact"), (4, "exact")}
    for s in r["steps"]:
        assert s["weight_bytes"] > 0 and s["kv_bytes"] > 0
        # The floor is a lower bound the measured step cannot beat by much (timer noise).
        assert 0 < s["floor_ms"] <= s["min_ms"] * 1.1 and s["min_ms"] <= s["p50_ms"]
        assert s["x_floor"] > 0.9
    kv = {s["streams"]: s["kv_bytes"] for s in r["steps"] if s["mode"] == "exact"}
    assert kv[4] > kv[1]  # four streams read more KV than one
    if fast:
        a = r["accuracy"]
        assert a["tokens"] > 10 and 0 <= a["top1_agreement"] <= 1 and a["ppl_ratio"] > 0
        for key in ("accuracy_int8", "accuracy_int8_vs_fast"):  # fast on an int8 KV cache
            assert r[key]["tokens"] == a["tokens"] and 0 <= r[key]["top1_agreement"] <= 1
        by = {(s["streams"], s["mode"]): s["kv_bytes"] for s in r["steps"]}
        assert by[4, "fast-int8"] < 0.5 * by[4, "fast"]  # a token's K/V as int8 plus a scale a row
    li = r["linears_in_step"]
    assert set(li) == set(r["numerics"]) and all(v["streams"] == 4 for v in li.values())
    # An HF model's exact linears run on the GEMM library, outside the fused decoder; the fast
    # mode's run in it, so they are timed inside the step.
    assert "fused C decoder" in li["exact"]["error"]
    if fast:
        assert li["fast"]["layers_ms"] > 0 and li["fast"]["head_ms"] > 0 and li["fast"]["gflops"] > 0
        assert li["fast"]["arithmetic"] == "bf16"  # an HF model's float weights: no blocks for int8
    assert {p["mode"] for p in r["prefill"]} == set(r["numerics"]) and all(p["tok_s"] > 0 for p in r["prefill"])
    assert "GGUF" in r["llama_bench"]["error"]  # an HF directory: llama-bench cannot read it
    assert "read bandwidth" in capsys.readouterr().out


def test_floors_serves_each_engine_last(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                        capsys) -> None:
    """--served: after the in-process part, stopline is served through its HTTP API and its
    output rate at each stream count lands in the same result."""
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "floors.json"
    rc = main(["bench", "floors", "--model", str(model), "--modes", "exact", "--streams", "1",
               "--buffer-mib", "16", "--reps", "1", "--warm", "1", "--steps", "2", "--num-blocks", "64",
               "--prefill-tokens", "0", "--out", str(out), "--served", "stopline",
               "--served-streams", "1", "2", "--served-tokens", "6", "--served-prompt-tokens", "8"])
    assert rc == 0
    r = json.loads(out.read_text())
    sv = r["served"]["engines"]["stopline"]
    assert set(sv["tok_s"]) == {"1", "2"} and all(t > 0 for t in sv["tok_s"].values()) and sv["errors"] == 0
    assert Path(r["served"]["results"]).is_file()
    # no peer and no llama-bench to compare with
    assert r["served_ratios"] == [{"engine": "stopline", "one_stream_tok_s": sv["tok_s"]["1"]}]
    assert r["served"]["temperature"] == 0.8  # sampled by default, each request seeded
    assert set(sv["itl_p50_ms"]) == {"1", "2"}
    assert "stopline: 1 streams" in capsys.readouterr().out


def test_served_ratios_against_tg128_and_the_best_peer() -> None:
    from stopline.bench import floors

    r = {"llama_bench": {"tg128_tok_s": 100.0},
         "served": {"engines": {"stopline": {"tok_s": {"1": 250.0, "32": 600.0}},
                                "stopline-fast": {"tok_s": {"1": 300.0, "32": 900.0}},
                                "llamacpp": {"tok_s": {"1": 80.0, "32": 150.0}},
                                "vllm": {"tok_s": {"1": 20.0, "32": 200.0}},
                                "hf": {"error": "setup_failed"}}}}
    exact, fast = floors.served_ratios(r)
    assert exact == {"engine": "stopline", "one_stream_tok_s": 250.0, "one_stream_x_tg128": 2.5,
                     "one_stream_best_peer": "llamacpp", "one_stream_x_best_peer": 3.125,
                     "streams": 32, "tok_s": 600.0, "best_peer": "vllm", "x_best_peer": 3.0}
    assert fast["one_stream_x_tg128"] == 3.0 and fast["x_best_peer"] == 4.5


def test_served_refuses_an_unknown_engine(tmp_path: Path) -> None:
    import argparse

    from stopline.bench import floors

    args = argparse.Namespace(served="stopline,nope", served_streams=[1], served_tokens=4,
                              served_prompt_tokens=4, out=str(tmp_path / "f.json"), model=None)
    with pytest.raises(SystemExit, match="unknown engine.*nope"):
        floors.served(args, ["stopline", "nope"])


def test_llama_bench_ratios_from_the_same_run(tmp_path: Path) -> None:
    """llama-bench's rates (a stand-in binary) against each mode's one-stream decode and prefill."""
    import argparse

    from stopline.bench import floors
    from tests.test_llama_bench import RUNS, _fake

    exe = _fake(tmp_path, f"cat <<'EOF'\n{json.dumps(RUNS)}\nEOF\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    args = argparse.Namespace(llama_bench=str(exe), model=str(gguf), reps_llama_bench=1)
    peer = floors.peer_llama_bench(args, 2)
    r = {"numerics": {"exact": "exact", "fast": "fast"},
         "steps": [{"mode": "exact", "streams": 1, "p50_ms": 5.0}, {"mode": "fast", "streams": 1, "p50_ms": 4.0},
                   {"mode": "fast", "streams": 32, "p50_ms": 9.0}],
         "prefill": [{"mode": "exact", "tokens": 512, "tok_s": 600.0}]}
    exact, fast = floors.vs_peer(r, peer)
    assert exact["decode_tok_s"] == pytest.approx(200.0)
    assert exact["decode_x_tg128"] == pytest.approx(200.0 / RUNS[1]["avg_ts"])
    assert exact["prefill_x_pp512"] == pytest.approx(600.0 / RUNS[0]["avg_ts"])
    assert fast["decode_tok_s"] == pytest.approx(250.0) and "prefill_tok_s" not in fast


def test_step_times_take_turns_that_start_untimed(monkeypatch) -> None:
    """Engines take turns of `turn` timed steps, each turn opened by `settle` untimed ones
    (its weights back in cache), and each engine is timed exactly `steps` times."""
    from stopline.bench import floors, offline

    log: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name, self.loaded, self.left = name, None, 0

        def add_request(self, rid, prompt, params) -> None:
            self.left = params.max_tokens

        def step(self) -> None:
            log.append(self.name)
            self.left -= 1

        def has_unfinished(self) -> bool:
            return self.left > 0

    monkeypatch.setattr(offline, "chat_prompts", lambda loaded, n: [[1, 2, 3]] * n)
    out = floors.step_times({"a": Fake("a"), "b": Fake("b")}, 1, warm=1, steps=5, turn=2, settle=1)
    timed = log[2:2 + 2 * (3 + 3 + 2)]  # after the warm step of each: turns of 1 + 2, 1 + 2, 1 + 1
    assert timed == list("aaabbbaaabbbaabb")
    assert set(out) == {"a", "b"} and all(v["min_ms"] <= v["p50_ms"] for v in out.values())
