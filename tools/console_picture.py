"""Make docs/img/console.png: the web console with the embedded model (SmolLM2 GGUF, the default
of `stopline serve`) answering one question, then a second answer stopped with Stop.

    python tools/console_picture.py [--out docs/img/console.png] [--chromium /usr/bin/chromium]

Starts `stopline serve` on a free loopback port (default model, engine core in its own
process), drives the console in headless Chromium (Playwright) as a user would, takes the
picture once the stopped request's blocks are back in the pool, and stops the server.
Greedy sampling, so the answers are the same on every run (the timing of the stop is not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

REPO = Path(__file__).resolve().parent.parent
ANSWERED = "Name three colors and say one thing about each."
STOPPED = "Tell me a long story about a robot who learns to cook."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready in {timeout} s")


def ask(page: Page, prompt: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#extra", "")
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def finish_of(page: Page, timeout_s: float) -> str | None:
    meta = page.wait_for_selector(".msg.assistant:last-child .meta[data-finish]", timeout=timeout_s * 1000)
    return meta.get_attribute("data-finish")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs/img/console.png")
    ap.add_argument("--chromium", default=os.environ.get("STOPLINE_CHROMIUM") or shutil.which("chromium")
                    or "/usr/bin/chromium")
    ap.add_argument("--stop-after-chars", type=int, default=300,
                    help="press Stop once the second answer has this many characters")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="stopline-console-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "stopline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", "--log-level", "warning"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            wait_ready(base, proc, log)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base + "/")
            page.wait_for_function("window.stopline.polls > 0 && window.stopline.snapshot.engine === 'ready'")

            ask(page, ANSWERED, 128)
            finish = finish_of(page, 300)
            print(f"first answer ended: {finish}", file=sys.stderr)

            ask(page, STOPPED, 1024)
            page.wait_for_function(
                f"""() => {{
                    const body = document.querySelector('.msg.assistant:last-child .body');
                    return body.textContent.length >= {args.stop_after_chars}
                        && document.querySelector('#requests tr.mine');
                }}""", timeout=300_000)
            page.click("#stop")
            finish = finish_of(page, 60)
            if finish != "abort":
                raise SystemExit(f"the second answer ended with {finish!r}, not abort: raise max tokens")
            # The live view has taken the stop in: no live request, the abort counted.
            page.wait_for_function(
                "() => !window.stopline.snapshot.live.length"
                " && Number(document.getElementById('aborts').dataset.total) >= 1", timeout=10_000)
            time.sleep(0.6)  # one more poll: the pool picture redrawn
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
            if errors:
                raise SystemExit(f"page errors: {errors}")
            print(f"wrote {args.out}", file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
