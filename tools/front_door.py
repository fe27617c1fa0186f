"""The front door as a newcomer meets it (DESIGN.md contract 13; run by .ci/run before the suite).

In a fresh virtual environment, run the README's first quick-start command, read from the
README so the two cannot drift, with `--port` added; wait for the server, ask it one chat
completion, stop it. With `--extras`, then the optional paths the docs give: `.[bench]` and
`stopline bench --help`, `.[ray]` and `stopline serve --replicas 2` answering on `/health`
inside a network namespace made for it (Ray listens on every interface).

Standard library only: it runs with whatever Python CI has, before anything is installed.

    python tools/front_door.py [--extras] [--venv DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_command() -> str:
    """The first fenced block under the README's "Quick start": one line, ending in `stopline serve`."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```\w*\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README: no code block under '## Quick start'")
    cmd = block.group(1).strip()
    if "\n" in cmd or not cmd.endswith("stopline serve"):
        raise SystemExit(f"README: the first command must be one line ending in 'stopline serve', got {cmd!r}")
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve_and_ask(cmd: list[str] | str, port: int, *, wait_s: float, log: Path, chat: bool = True) -> None:
    """Start `cmd` (a server on `port`) in its own process group, wait for /health, ask, stop it."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, shell=isinstance(cmd, str), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                executable="/bin/bash" if isinstance(cmd, str) else None)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"front door: exited {proc.returncode} before serving; its log:\n"
                                 + log.read_text()[-4000:])
            if time.monotonic() > deadline:
                raise SystemExit(f"front door: no healthy server after {wait_s:.0f} s; its log:\n"
                                 + log.read_text()[-4000:])
            try:
                status, body = _get(base + "/health")
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(1.0)
        print(f"  /health 200: {body.decode()[:200]}", flush=True)
        if chat:
            model = json.loads(_get(base + "/v1/models")[1])["data"][0]["id"]
            res = _post(base + "/v1/chat/completions", {
                "model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            choice = res["choices"][0]
            if not choice["message"]["content"] or choice["finish_reason"] not in ("stop", "length"):
                raise SystemExit(f"front door: a bad answer: {res}")
            print(f"  {model} answered {choice['message']['content']!r} "
                  f"({choice['finish_reason']})", flush=True)
    finally:
        # A shell's last command is its child, so the shell's group gets the SIGTERM; a server
        # started directly gets it alone (Ray's processes in its group would log their own).
        if proc.poll() is None:
            if isinstance(cmd, str):
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        proc.wait()


def run(cmd: str, env: dict[str, str]) -> None:
    print(f"$ {cmd}", flush=True)
    subprocess.run(["/bin/bash", "-c", cmd], cwd=REPO, env=env, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", action="store_true", help="also the bench and ray extras' paths")
    ap.add_argument("--venv", default=None, help="where to make the environment (default: a temp dir)")
    ap.add_argument("--wait-s", type=float, default=1800.0,
                    help="seconds the command may take to install and serve")
    ap.add_argument("--inner-replicas", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="front-door-"))

    if args.inner_replicas:  # inside the network namespace: the venv's python runs this
        port = free_port()
        serve_and_ask([str(Path(sys.executable).parent / "stopline"), "serve", "--replicas",
                       str(args.inner_replicas), "--port", str(port)], port, wait_s=args.wait_s,
                      log=logs / "replicas.log")
        return 0

    venv = Path(args.venv or tempfile.mkdtemp(prefix="front-door-venv-"))
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
            "RAY_USAGE_STATS_ENABLED": "0"}
    activate = f"source {shlex.quote(str(venv / 'bin' / 'activate'))} && "

    cmd = readme_command()
    port = free_port()
    print(f"front door, in a fresh environment ({venv}):\n$ {cmd} --port {port}", flush=True)
    t0 = time.monotonic()
    serve_and_ask(activate + cmd + f" --port {port}", port, wait_s=args.wait_s, log=logs / "serve.log")
    print(f"  served and stopped in {time.monotonic() - t0:.0f} s", flush=True)
    if not args.extras:
        return 0

    run("pip install -q -e '.[bench]'", env)
    run("stopline bench --help >/dev/null && stopline bench soak --help >/dev/null", env)
    run("pip install -q -e '.[ray]'", env)
    inner = [str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--inner-replicas", "2",
             "--wait-s", "600"]
    print("$ stopline serve --replicas 2 (in a network namespace)", flush=True)
    subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner],
                   cwd=REPO, env=env, check=True)
    print(f"front door and extras: all passed in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
