"""The engines under test: how each one is started, and how its metrics are named.

stopline is started with its own CLI; peers with the scripts in bench/peers/ (outside the
package: they install into their own prefixes). Each engine runs alone on the machine while
it is measured, on a free loopback port, and is stopped (its own process group) after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import stopline
from stopline.bench.llama_bench import died
from stopline.bench.probe import MetricNames

MODEL_NAME = "SmolLM2-135M-Instruct"
# The KV pool every engine that has one gets unless a workload sizes it (vLLM's
# VLLM_CPU_KVCACHE_SPACE). stopline's own default (1 GiB) holds ~23k float32 tokens of
# SmolLM2: less than 64 streams x (118 + 256) tokens, which made the 64-stream level wait for
# blocks while vLLM had 2 GiB.
KV_GIB = 2
PEERS_DIR = Path(__file__).resolve().parents[2] / "bench" / "peers"

STOPLINE_METRICS = MetricNames(
    kv_used=("stopline_kv_blocks_used",), kv_total=("stopline_kv_blocks_total",),
    busy=("stopline_requests_running", "stopline_requests_waiting", "stopline_requests_preempted"),
    gen_tokens=("stopline_generation_tokens_total",), gen_tokens_per_step=False,
    tokens_after_abort=("stopline_tokens_after_abort_total",),
    preemptions=("stopline_preemptions_total",), recomputed=("stopline_recomputed_tokens_total",))
VLLM_METRICS = MetricNames(
    kv_used=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    gen_tokens=("vllm:generation_tokens_total",),
    preemptions=("vllm:num_preemptions_total",))
LLAMACPP_METRICS = MetricNames(
    kv_used=("llamacpp:kv_cache_usage_ratio",),
    busy=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    gen_tokens=("llamacpp:tokens_predicted_total",), gen_tokens_per_step=False)
HF_METRICS = MetricNames(busy=("hf_requests_running", "hf_requests_waiting"),
                         gen_tokens=("hf_generation_tokens_total",))


@dataclass
class EngineSpec:
    """How to start one engine. `command(port, kv_tokens)` builds its command line; kv_tokens
    (None: the engine's default pool) sizes the KV pool for the preemption storm."""

    name: str
    command: Callable[[int, int | None, dict[str, str]], list[str]]
    metrics: MetricNames
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 300.0
    can_size_kv: bool = True  # False: no KV pool to shrink (the preemption storm is N/A)
    no_kv_why: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stopline_spec(model: str | None = None, extra: list[str] | None = None,
                  block_size: int = 16) -> EngineSpec:
    def command(port: int, kv_tokens: int | None, variant: dict[str, str]) -> list[str]:
        cmd = [sys.executable, "-m", "stopline.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", MODEL_NAME, "--log-level", "warning",
               "--no-access-log", "--block-size", str(block_size)]
        if model is not None:
            cmd += ["--model", model]
        if kv_tokens is not None:
            cmd += ["--num-blocks", str(-(-kv_tokens // block_size))]
        else:
            cmd += ["--kv-cache-gb", str(KV_GIB)]
        for key, value in variant.items():
            cmd += [f"--{key}", value]
        return cmd + list(extra or [])
    return EngineSpec("stopline", command, STOPLINE_METRICS, start_timeout=300.0)


def vllm_spec(block_size: int = 32) -> EngineSpec:
    def command(port: int, kv_tokens: int | None, variant: dict[str, str]) -> list[str]:
        cmd = ["bash", str(PEERS_DIR / "start_vllm.sh"), "--block-size", str(block_size)]
        if kv_tokens is not None:
            blocks = -(-kv_tokens // block_size)
            # vLLM refuses to start when one max-length sequence can't fit in the pool, and it
            # keeps one block of the pool back (measured: 21 blocks of 32 admit 640 tokens).
            cmd += ["--num-gpu-blocks-override", str(blocks),
                    "--max-model-len", str((blocks - 1) * block_size)]
        return cmd
    return EngineSpec("vllm", command, VLLM_METRICS, env={"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)},
                      start_timeout=900.0)


def llamacpp_spec(model: str | None = None, name: str = "llamacpp",
                  script: str = "start_llamacpp.sh") -> EngineSpec:
    """llama-server on the GGUF stopline serves: the embedded one, a file, or a package's."""
    env = {"MODEL": str(gguf_file(model))} if model is not None else {}

    def command(port: int, kv_tokens: int | None, variant: dict[str, str]) -> list[str]:
        return ["bash", str(PEERS_DIR / script)]
    return EngineSpec(name, command, LLAMACPP_METRICS, env=env, start_timeout=300.0,
                      can_size_kv=False,
                      no_kv_why="llama-server reserves each slot's context up front (-np x -c/np); "
                                "a smaller pool truncates or rejects requests instead of preempting")


def ikllamacpp_spec(model: str | None = None) -> EngineSpec:
    """ik_llama.cpp's llama-server, its weights repacked at load (-rtr), on the same GGUF."""
    return llamacpp_spec(model, "ikllamacpp", "start_ikllamacpp.sh")


def gguf_file(model: str) -> Path:
    """The GGUF file a --model names (a path or an installed package's), for a peer that reads
    GGUF only; an HF directory is refused."""
    from stopline.model.loaders.loader import package_model_path

    path = Path(model).expanduser()
    if not path.exists():
        path = package_model_path(model)
    if not path.is_file():
        raise ValueError(f"llama.cpp serves GGUF files only; {model!r} is not one")
    return path


def hf_spec() -> EngineSpec:
    def command(port: int, kv_tokens: int | None, variant: dict[str, str]) -> list[str]:
        return ["bash", str(PEERS_DIR / "start_hf.sh")]
    return EngineSpec("hf", command, HF_METRICS, start_timeout=300.0, can_size_kv=False,
                      no_kv_why="HF generate runs one prompt at a time with its own dynamic cache; "
                                "there is no shared pool to preempt from")


def spec_for(name: str, model: str | None = None) -> EngineSpec:
    makers = {"stopline": lambda: stopline_spec(model),
              # the fast numerics mode (docs/numerics.md), served the same way
              "stopline-fast": lambda: dataclasses.replace(
                  stopline_spec(model, extra=["--numerics", "fast"]), name="stopline-fast"),
              # fast numerics on the int8 KV cache: a quarter of the cache bytes a step reads
              "stopline-fast-int8": lambda: dataclasses.replace(
                  stopline_spec(model, extra=["--numerics", "fast", "--kv-cache-dtype", "int8"]),
                  name="stopline-fast-int8"),
              "vllm": vllm_spec, "llamacpp": lambda: llamacpp_spec(model),
              "ikllamacpp": lambda: ikllamacpp_spec(model), "hf": hf_spec}
    if name not in makers:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(makers)}")
    return makers[name]()


class EngineStartError(RuntimeError):
    pass


_LIVE: set[RunningEngine] = set()


def stop_all() -> None:
    """Stop every engine this process started (the bench's last line of defence)."""
    for eng in list(_LIVE):
        eng.stop()


class RunningEngine:
    """A started engine process (own process group), its URL and its log."""

    def __init__(self, spec: EngineSpec, log_path: Path, kv_tokens: int | None = None,
                 variant: dict[str, str] | None = None, port: int | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = spec.command(self.port, kv_tokens, dict(variant or {}))
        env = os.environ | spec.env | {"PORT": str(self.port), "SERVED_NAME": MODEL_NAME}
        if stopline.SPIN_SET_HERE:
            # The OpenMP spin this process got from `import stopline` is not the user's: each
            # engine starts with its own default (stopline's server sets it again).
            env.pop("GOMP_SPINCOUNT", None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        _LIVE.add(self)

    def wait_ready(self) -> float:
        """Seconds until /health answers 200; EngineStartError with the log's tail otherwise."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.spec.start_timeout:
            if self.proc.poll() is not None:
                raise EngineStartError(f"{self.spec.name} {died(self.proc.returncode)} "
                                       f"while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            time.sleep(0.25)
        self.stop()
        raise EngineStartError(f"{self.spec.name} not ready after {self.spec.start_timeout:.0f} s:\n"
                               f"{self.log_tail()}")

    def death(self) -> str | None:
        """How the engine ended if it is gone (a native build's SIGILL, say), else None."""
        return None if self.proc.poll() is None else died(self.proc.returncode)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            # The whole group: the start scripts exec, but engines fork workers of their own.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        _LIVE.discard(self)
