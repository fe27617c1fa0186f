"""Soak the /v1/responses store: it must stay flat however many responses go through it.

Starts a server (given model, or SmolLM2) with `--responses-max-stored BOUND`, then sends
TOTAL stored responses (half foreground, half background, some chained by
previous_response_id, every fourth background one cancelled) and prints, every STEP of them,
the stored and running gauges, the evictions and the server process's RSS.

    python tools/responses_soak.py [MODEL_DIR_OR_GGUF] [TOTAL] [BOUND] [-- extra serve options]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from tests.server_harness import ServerProcess  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    args, extra = (sys.argv[1:], [])
    if "--" in args:
        at = args.index("--")
        args, extra = args[:at], args[at + 1:]
    model = args[0] if args else None
    total = int(args[1]) if len(args) > 1 else 2000
    bound = int(args[2]) if len(args) > 2 else 100
    serve = (["--model", model] if model else []) + ["--responses-max-stored", str(bound), *extra]
    srv = ServerProcess(*serve)
    try:
        srv.wait_ready(timeout=300)
        name = httpx.get(srv.base + "/v1/models").json()["data"][0]["id"]
        step = max(1, total // 10)
        prev = None
        print(f"{'sent':>6} {'stored':>6} {'running':>7} {'evicted':>7} {'rss MiB':>8}")
        with httpx.Client(base_url=srv.base, timeout=120) as http:
            for k in range(1, total + 1):
                body = {"model": name, "input": f"Item {k}: say something", "max_output_tokens": 8,
                        "temperature": 0, "background": k % 2 == 0}
                if prev is not None and k % 3 == 0:
                    body["previous_response_id"] = prev
                r = http.post("/v1/responses", json=body)
                r.raise_for_status()
                rid = r.json()["id"]
                if body["background"] and k % 8 == 0:
                    http.post(f"/v1/responses/{rid}/cancel").raise_for_status()
                elif body["background"]:
                    while http.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress"):
                        time.sleep(0.005)
                prev = rid if not body["background"] else prev
                if k % step == 0:
                    m = srv.metrics()
                    print(f"{k:>6} {m['stopline_responses_stored']:>6.0f} "
                          f"{m['stopline_responses_background_running']:>7.0f} "
                          f"{m['stopline_responses_evicted_total']:>7.0f} {rss_mib(srv.proc.pid):>8.1f}",
                          flush=True)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
