"""All layers of a step in one C call (stopline/model/decoder_native.py), on a tiny model
stored as Q4_1 so that every linear runs on the quantized kernel."""

from __future__ import annotations

import time

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.decoder_native import DecoderLoop, StepInterrupt
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, SamplingParams
from tests.engine_support import greedy_logprobs
from tests.tiny_model import make_tiny_llama_dir

PROMPT = [5, 17, 99, 23, 42, 7, 300, 12, 9, 81]


@pytest.fixture
def q4(tiny_q4):
    return tiny_q4


def engine(q4, **kw) -> EngineCore:
    cfg = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, quant_max_rows=16, debug=True,
               target_step_ms=None)
    cfg.update(kw)
    return EngineCore(q4, EngineConfig(**cfg))


def count_runs(eng: EngineCore) -> dict:
    """Counts the steps that went through the C loop."""
    calls = {"n": 0}
    run = eng.model.decoder.run

    def counted(*args):
        calls["n"] += 1
        return run(*args)

    eng.model.decoder.run = counted
    return calls


def test_the_c_loop_gives_every_row_the_python_loops_bits(q4):
    """Same tokens and the same float logprobs, for decode steps (C loop) and for prefill
    steps past quant_max_rows (Python loop, library GEMMs) alike."""
    prompts = [PROMPT[: 3 + i] * (1 + i % 3) for i in range(9)]
    c_eng = engine(q4)
    assert c_eng.model.decoder is not None
    calls = count_runs(c_eng)
    with_c = greedy_logprobs(c_eng, prompts)
    py_eng = engine(q4)
    py_eng.model.c_layers = False
    assert with_c == greedy_logprobs(py_eng, prompts)
    assert calls["n"] > 10  # the decode steps ran in C


@pytest.mark.parametrize("kernel", ["amx", "avx512", "int8"])
def test_fast_mode_c_loop_gives_the_python_loops_bits(q4, kernel, monkeypatch):
    """The fast numerics mode runs every step's layers in C (any row count: prefill too),
    on the kernel each weight was built for (bf16 with the Q4_1 blocks up to the same row
    count, or the blocks against int8 inputs), so rows get the layer loop's bits exactly."""
    from stopline.model.kernels.bf16_linear import BF16Weight
    from stopline.model.kernels.int8_linear import Int8Weight, has_vnni
    from stopline.model.kernels.native import amx_ready, has_bf16

    if not has_bf16() or (kernel == "amx" and not amx_ready()) or (kernel == "int8" and not has_vnni()):
        pytest.skip(f"no {kernel} kernel on this host")
    monkeypatch.setenv("STOPLINE_AMX", "1" if kernel == "amx" else "0")
    monkeypatch.setenv("STOPLINE_INT8", "1" if kernel == "int8" else "0")
    prompts = [PROMPT[: 3 + i] * (1 + i % 3) for i in range(9)]
    c_eng = engine(q4, numerics="fast")
    lin = c_eng.model.layers[0]["gate_up"].fast
    if kernel == "int8":
        assert isinstance(lin, Int8Weight)
    else:
        assert isinstance(lin, BF16Weight) and lin.q4 is not None and lin.amx == (kernel == "amx")
    assert c_eng.model.decoder is not None
    calls = count_runs(c_eng)
    with_c = greedy_logprobs(c_eng, prompts)
    py_eng = engine(q4, numerics="fast")
    py_eng.model.c_layers = False
    assert with_c == greedy_logprobs(py_eng, prompts)
    assert calls["n"] > 10
    exact = greedy_logprobs(engine(q4), prompts)
    assert exact != with_c  # really the fast arithmetic


def test_abort_of_every_request_stops_the_c_loop(q4):
    """An abort that empties the step in flight sets the interrupt the C loop reads before
    each layer; the step ends there and the next request is unaffected."""
    eng = engine(q4)
    xi = eng.add_request("x", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    yi = eng.add_request("y", PROMPT[:5], SamplingParams(temperature=0.0, max_tokens=8))
    eng.step()  # the prompts (7 + 5 rows, in C too)
    run = eng.model.decoder.run

    def abort_then_run(x, inp, kv, interrupt):
        eng.abort([xi, yi], AbortSource.CANCEL, time.monotonic())  # arrives while the step is in flight
        assert isinstance(interrupt, StepInterrupt) and interrupt.flag.item() == 1
        return run(x, inp, kv, interrupt)

    eng.model.decoder.run = abort_then_run
    finished = {}
    while eng.has_unfinished():
        finished |= {o.request_id: o.finish_reason for o in eng.step() if o.finished}
    assert eng.interrupted_steps == 1
    assert finished == {"x": FinishReason.ABORT, "y": FinishReason.ABORT}
    eng.model.decoder.run = run
    alone = greedy_logprobs(engine(q4), [PROMPT * 2])
    assert greedy_logprobs(eng, [PROMPT * 2]) == alone


def test_step_interrupt_mirrors_its_state_for_c():
    ev = StepInterrupt()
    assert ev.flag.item() == 0 and not ev.is_set()
    ev.set()
    assert ev.flag.item() == 1 and ev.is_set()
    ev.clear()
    assert ev.flag.item() == 0 and not ev.is_set()


def test_no_c_loop_without_quantized_weights(tmp_path_factory):
    """A float32 model (HF safetensors) has no blocks for the quantized kernel: the layers
    stay in the Python loop."""
    hf = make_tiny_llama_dir(tmp_path_factory.mktemp("decoder_f32") / "tiny", seed=9, vocab_size=384)
    eng = EngineCore(load_model(str(hf), progress=False), EngineConfig(num_blocks=32, block_size=4))
    assert eng.model.decoder is None and not DecoderLoop.supports(eng.model)


def test_the_c_loop_times_its_linears_without_changing_a_bit(q4):
    """DecoderLoop.linear_s (what `bench floors` reads): set, the loop adds its linears'
    seconds to it, and every logprob is the untimed loop's."""
    import torch

    prompts = [PROMPT[: 4 + i] for i in range(4)]
    untimed = greedy_logprobs(engine(q4), prompts)
    timed_eng = engine(q4)
    timed_eng.model.decoder.linear_s = torch.zeros(1, dtype=torch.float64)
    assert greedy_logprobs(timed_eng, prompts) == untimed
    assert timed_eng.model.decoder.linear_s[0] > 0
