"""lm-eval against `stopline serve`: a multiple-choice task scored through the OpenAI surface
(`local-completions`: echo + logprobs over token-id prompts) and through lm-eval's own HF
backend on the same weights; every item's every choice must get the same log-likelihood
within 1e-3.

Needs lm-eval, which is not a stopline dependency; keep it in its own venv that sees this
one's packages (so it brings no second torch):

    python -m venv --system-site-packages .venv-lmeval
    .venv-lmeval/bin/pip install "lm-eval[api]==0.4.13" accelerate
    .venv-lmeval/bin/python bench/lm_eval/check.py [--out docs/bench-data/lm-eval.json]

The task (mc_items.jsonl beside this file, 24 four-way science questions) is defined from a
local file: nothing is fetched from a hub.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
TASK = "stopline_mc"
TOLERANCE = 1e-3
_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, name: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "stopline.cli", "serve", "--port", str(port),
                             "--served-model-name", name, "--log-level", "warning"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stopline serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("stopline serve did not become ready in 300 s")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _per_choice(results: dict) -> dict[tuple[int, int], float]:
    """(doc id, choice index) -> log-likelihood, from lm-eval's logged samples."""
    out = {}
    for s in results["samples"][TASK]:
        for k, resp in enumerate(s["filtered_resps"]):
            out[(s["doc_id"], k)] = float(resp[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    import lm_eval
    from lm_eval.tasks import TaskManager

    from stopline.model.loaders.loader import default_model_path, export_hf_dir, load_model

    work = Path(tempfile.mkdtemp(prefix="stopline-lmeval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(_YAML.format(task=TASK, data=HERE / "mc_items.jsonl"))
    hf_dir = export_hf_dir(load_model(default_model_path(), progress=False), work / "hf")
    manager = TaskManager(include_path=str(tasks))

    port = _free_port()
    name = "smollm2"
    server = _serve(port, name)
    try:
        t0 = time.perf_counter()
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=[TASK], task_manager=manager, log_samples=True,
            model_args=(f"base_url=http://127.0.0.1:{port}/v1/completions,model={name},"
                        f"tokenizer={hf_dir},tokenizer_backend=huggingface,num_concurrent=1,"
                        "max_retries=1"))
        served_s = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    t0 = time.perf_counter()
    hf = lm_eval.simple_evaluate(model="hf", tasks=[TASK], task_manager=manager, log_samples=True,
                                 model_args=f"pretrained={hf_dir},dtype=float32,device=cpu",
                                 batch_size=1)
    hf_s = time.perf_counter() - t0

    a, b = _per_choice(served), _per_choice(hf)
    if a.keys() != b.keys():
        print(f"FAIL: the two runs scored different items ({len(a)} vs {len(b)})")
        return 1
    worst = max(abs(a[k] - b[k]) for k in a)
    acc = {k: r["results"][TASK]["acc,none"] for k, r in (("stopline", served), ("hf", hf))}
    figures = {"task": TASK, "items": len({d for d, _ in a}), "choices_scored": len(a),
               "max_abs_loglik_diff": worst, "tolerance": TOLERANCE, "acc": acc,
               "seconds": {"stopline": round(served_s, 1), "hf": round(hf_s, 1)},
               "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "?",
               "host": f"{_cpu_name()}, {os.cpu_count()} CPUs"}
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    if worst > TOLERANCE:
        print(f"FAIL: per-choice log-likelihoods differ by {worst:.2e} > {TOLERANCE:.0e}")
        return 1
    print(f"OK: {len(a)} log-likelihoods equal lm-eval's HF backend within {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
