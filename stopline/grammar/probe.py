"""A killable process that tries a grammar compile before the engine's process does it.

llguidance's compile is one Rust call that can't be interrupted from another thread, and
its limits are checked late: a 40,000-rule Lark grammar ran 6.9 s on 2 cores before it was
refused as too big (bench/grammar_mask.py --worst). So each grammar is first compiled in
this child process, which is killed the moment the last request waiting for it goes away or
its deadline passes; only a grammar the child compiled in time is then compiled again in
the engine's process (where the matcher must live), which costs it once more (1-10 ms for
the schemas of bench/grammar_mask.py) and is bounded by what the child measured.

Run as a script (`python -I probe.py`): it imports llguidance only, not stopline (whose
package import loads torch). Messages both ways are a 4-byte big-endian length and JSON.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

STOPPED = "stopped"  # check(): the caller asked to stop; the child was killed


def _send(f: BinaryIO, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode("utf-8")
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def _recv(f: BinaryIO) -> dict[str, Any] | None:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return json.loads(f.read(n).decode("utf-8"))


class Probe:
    """The parent's handle on the child. Used by one thread at a time (the compile thread)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int], limits: dict[str, Any]) -> None:
        self._hello = {"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos, "limits": limits}
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._ready = False

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the child (it builds its tokenizer, ~1 s) unless it runs already."""
        if self.alive:
            return
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
        self._buf, self._ready = b"", False
        assert self._proc.stdin is not None
        _send(self._proc.stdin, self._hello)

    def kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    f.close()
            self._proc = None

    close = kill

    def _read(self, stop: Callable[[], bool]) -> dict[str, Any] | str | None:
        """The child's next message; STOPPED if stop() turned true first; None if it died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            if len(self._buf) >= 4:
                (n,) = struct.unpack(">I", self._buf[:4])
                if len(self._buf) >= 4 + n:
                    msg, self._buf = self._buf[4:4 + n], self._buf[4 + n:]
                    return json.loads(msg.decode("utf-8"))
            if stop():
                return STOPPED
            ready, _, _ = select.select([fd], [], [], 0.01)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk

    def wait_ready(self, stop: Callable[[], bool]) -> str | None:
        """None once the child can take a grammar; STOPPED; or why it can't start."""
        self.start()
        if self._ready:
            return None
        got = self._read(stop)
        if got == STOPPED:
            return STOPPED  # the child keeps starting: the next compile uses it
        if not isinstance(got, dict) or not got.get("ready"):
            self.kill()
            return "the grammar compile process failed to start"
        self._ready = True
        return None

    def check(self, grammar: str, stop: Callable[[], bool]) -> tuple[str | None, float]:
        """(error or None, seconds the child took). The error is STOPPED when stop() turned
        true first: the child is killed then (and restarted, for the next compile)."""
        assert self._proc is not None and self._proc.stdin is not None and self._ready
        t0 = time.monotonic()
        try:
            _send(self._proc.stdin, {"grammar": grammar})
        except (BrokenPipeError, OSError):
            self.kill()
            return "the grammar compile process died", 0.0
        got = self._read(stop)
        if got == STOPPED:
            self.kill()
            self.start()
            return STOPPED, time.monotonic() - t0
        if not isinstance(got, dict):
            self.kill()  # it crashed on this grammar
            return "the grammar compile crashed", time.monotonic() - t0
        return got.get("error"), float(got.get("seconds", 0.0))


def _child() -> None:
    import llguidance

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    hello = _recv(inp)
    if hello is None:
        return
    ll = llguidance.LLTokenizer(hello["tokenizer"], n_vocab=hello["n_vocab"], eos_token=hello["eos"])
    limits = llguidance.LLParserLimits(**hello["limits"])
    _send(out, {"ready": True})
    while (msg := _recv(inp)) is not None:
        t0 = time.monotonic()
        m = llguidance.LLMatcher(ll, msg["grammar"], log_level=0, limits=limits)
        _send(out, {"error": m.get_error() if m.is_error() else None,
                    "seconds": time.monotonic() - t0})


if __name__ == "__main__":
    _child()
