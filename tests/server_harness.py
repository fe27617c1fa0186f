"""Run `stopline serve` as a real subprocess on a free loopback port, and read its metrics."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A base port P with P..P+n-1 free on loopback, below Linux's ephemeral range (32768 and
    up by default), so no client's outgoing connection takes one before it is bound."""
    for _ in range(200):
        base = random.randrange(20000, 32768 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> None:
        self.port = free_ports(1)
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="stopline-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "stopline.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--no-access-log", "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def openai(self, timeout: float = 60.0) -> openai.OpenAI:
        """The official client on this server, without retries (a retry would hide a failure)."""
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "x", max_retries=0,
                             timeout=timeout)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def core_pid(self) -> int:
        """The engine-core process: the server's child started by multiprocessing's spawn (not
        its resource tracker)."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    pids.append(int(pid))
        if len(pids) != 1:
            raise RuntimeError(f"expected one engine-core child of the server, found {pids}")
        return pids[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        os.unlink(self.log.name)

    # ---- metrics --------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
                if "replica" in s.labels:  # Ray replicas: also their sum, as one engine reports it
                    rest = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "replica")
                    name = f"{s.name}{{{rest}}}" if rest else s.name
                    out[name] = out.get(name, 0.0) + s.value
        return out

    def wait_idle(self, baseline_used: float = 0.0, timeout: float = 1.0) -> float:
        """Seconds until no request runs, waits or is preempted and the KV blocks in use are
        back to baseline; fails after `timeout`."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if (m["stopline_requests_running"] == 0 and m["stopline_requests_waiting"] == 0
                    and m["stopline_requests_preempted"] == 0
                    and m["stopline_kv_blocks_used"] == baseline_used):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"engine not idle {timeout} s after the cancel: "
                                     f"{ {k: v for k, v in m.items() if k.startswith('stopline_requests') or k.startswith('stopline_kv')} }")
            time.sleep(0.01)

    def wait_for(self, predicate, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until predicate(metrics) holds."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"condition not met in {timeout} s; running="
                                     f"{m['stopline_requests_running']} waiting={m['stopline_requests_waiting']}")
            time.sleep(0.01)


@contextmanager
def serving(srv: ServerProcess) -> Iterator[ServerProcess]:
    """srv once ready; stopped on the way out, whether it became ready or not."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def started(*args: str) -> ServerProcess:
    """A `stopline serve` with these arguments, ready to take requests."""
    srv = ServerProcess(*args)
    srv.wait_ready()
    return srv


@contextmanager
def split_and_single(*args: str, reclaim_s: float) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The same model and flags served twice: as the prefill/decode split (`--disagg`) and as
    one in-process engine, the split's reference; both stopped on the way out."""
    split = single = None
    try:
        split = started(*args, "--disagg", "--reclaim-s", str(reclaim_s))
        single = started(*args, "--in-process")
        yield split, single
    finally:
        for s in (split, single):
            if s is not None:
                s.stop()


def total(m: dict[str, float], prefix: str) -> float:
    """Sum of every sample whose key starts with prefix (e.g. one label of a counter)."""
    return sum(v for k, v in m.items() if k.startswith(prefix))


def raw_request(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> socket.socket:
    """Send one HTTP request on a raw socket and return the socket, unread: closing it is a
    client that drops its connection."""
    s = socket.create_connection(("127.0.0.1", port))
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s
