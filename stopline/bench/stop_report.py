"""Markdown for `stopline bench stop` results: the whole report, and its summary in a line."""

from __future__ import annotations

import shlex

from stopline.bench import machine

# Options that only choose where a benchmark's output goes: not part of the command that
# reproduces its result.
OUTPUT_OPTIONS = {"--report": 1, "--results-dir": 1, "--out": 1, "--no-progress": 0}


def reproducible(command: str | None) -> str:
    """`command` without the options that only choose where its output goes."""
    if not command:
        return ""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    out, skip = [], 0
    for w in words:
        if skip:
            skip -= 1
        elif w.split("=", 1)[0] in OUTPUT_OPTIONS:
            skip = 0 if "=" in w else OUTPUT_OPTIONS[w]
        else:
            out.append(w)
    return shlex.join(out)


def summary(r: dict, file: str) -> str:
    """The headline figures of a `bench stop` result, for docs/benchmarks.md."""
    c, h, p = r["cancel_storm"], r["cancel_storm_under_pressure"], r["preemption_storm"]
    ratios = ", ".join(f"{row['mode']}/{row['policy']} {_f(row['ratio_vs_unconstrained'])}" for row in p["rows"])
    return (f"**Cost of stopping** (`{reproducible(r['command'])}` on {machine.summary(r['machine'])}; `{file}`; detail in "
            f"[stop-benchmark.md](stop-benchmark.md)): cancel storm ratio {_f(c['ratio_twins_over_aborts'])} "
            f"({_f(h['ratio_twins_over_aborts'])} with the pool at half the demand), "
            f"{_f(c['tokens_after_abort_per_abort'], 1)} tokens computed after an abort; preemption storm "
            f"against the same storm unconstrained (target 0.8): {ratios}.")


def _commit(r: dict) -> str:
    """Torch and the commit, where the results file has them (older ones name torch in the machine)."""
    parts = [f"torch {r['torch']}" if r.get("torch") else "", f"commit {r['git']}" if r.get("git") else ""]
    return "".join(f", {x}" for x in parts if x)


def _f(x: object, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _runs(c: dict, side: str) -> str:
    """The runs behind a mean (results from before the runs were repeated have one)."""
    runs = c.get("survivors_s_runs", {}).get(side)
    return f" (mean of {', '.join(_f(x) for x in runs)})" if runs else ""


def _ratio_runs(row: dict) -> str:
    rs = row.get("ratio_runs", [])
    return f" ({', '.join(_f(x, 3) for x in rs)})" if len(rs) > 1 else ""


def _where(r: dict) -> str:
    """The one host and command of every table of the report, named right above each."""
    return f"On {machine.summary(r['machine'])}{_commit(r)}: `{reproducible(r['command'])}`"


def _cancel(title: str, c: dict, r: dict) -> list[str]:
    return [
        f"### {title}",
        "",
        f"{c['requests']} requests, {c['aborted']} aborted "
        f"(before first token {c['abort_kinds']['waiting']}, mid-prefill {c['abort_kinds']['prefill']}, "
        f"mid-decode {c['abort_kinds']['decode']}), max_tokens {c['max_tokens']}.",
        "",
        _where(r),
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| survivors' completion, with aborts (s) | {_f(c['survivors_s_with_aborts'])}{_runs(c, 'aborts')} | |",
        f"| survivors' completion, with twins (s) | {_f(c['survivors_s_with_twins'])}{_runs(c, 'twins')} | |",
        f"| ratio twins / aborts | {_f(c['ratio_twins_over_aborts'], 3)} | >= 0.95 |",
        f"| tokens computed after abort, per aborted request | {_f(c['tokens_after_abort_per_abort'], 3)} | <= 1 step's worth (1) |",
        f"| steps from abort to reclaim (max) | {c['abort_to_reclaim_steps_max']} | <= 1 |",
        f"| abort to reclaim, p50 / p99 (ms) | {_f(c['reclaim_ms_p50'])} / {_f(c['reclaim_ms_p99'])} | |",
        f"| preemptions during the run | {c['preemptions'] or 0} | |",
        "",
    ]


def render(r: dict) -> str:
    p = r["preemption_storm"]
    lines = [
        "# Cost of stopping (stopline bench stop)",
        "",
        "Model: SmolLM2-135M-Instruct (GGUF, fp32 compute), greedy, EOS ignored. In-process engine "
        "core; figures from one run, whose host and command head each table.",
        "",
        "A twin is the same request with max_tokens set to the tokens its aborted counterpart had "
        "received, so it stops by itself at the same point; a request aborted before its first token "
        "or mid-prefill gets a twin with max_tokens=1 (a natural stop can't come earlier), which "
        "makes those twins slightly more expensive than the aborts they stand for. The runs go "
        "aborts, twins, twins, aborts, each on a fresh engine, and each side is the mean of its two; "
        "the counts of tokens after abort, reclaim steps and preemptions cover both runs with aborts.",
        "",
    ]
    lines += _cancel("Cancel storm", r["cancel_storm"], r)
    lines += _cancel("Cancel storm with the pool at half the demand (aborts under preemption)",
                     r["cancel_storm_under_pressure"], r)
    side = p.get("method") == "side by side"
    lines += [
        "### Preemption storm",
        "",
        f"{p['requests']} requests x {p['max_tokens']} tokens; demand {p['demand_blocks']} blocks, "
        f"pool {p['pool_blocks']} blocks. Unconstrained: {_f(p['unconstrained_tok_s'], 1)} tok/s, "
        f"{_f(p.get('unconstrained_tokens_per_step'), 1)} tokens per step"
        + _reference(p)
        + (f" Each pair ran {p['rounds']} times, once a round; its ratio is the mean of its runs'."
           if p.get("rounds", 1) > 1 else ""),
        "",
        _where(r),
        "",
        f"| mode | victim policy | tok/s | unconstrained {'beside' if side else 'around'} it | vs unconstrained "
        "(target >= 0.8) | tokens per step | preemptions | recomputed tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in p["rows"]:
        lines.append(f"| {row['mode']} | {row['policy']} | {_f(row['tok_s'], 1)} | "
                     f"{_f(row.get('unconstrained_around_tok_s', p['unconstrained_tok_s']), 1)} | "
                     f"{_f(row['ratio_vs_unconstrained'], 3)}{_ratio_runs(row)} | {_f(row.get('tokens_per_step'), 1)} | "
                     f"{row['preemptions']} {row['by_mode'] or ''} | "
                     f"{row['recomputed_tokens']} |")
    fresh, after = p["light_wave_tok_s_fresh"], p["light_wave_tok_s_after_storm"]
    lines += [
        "",
        f"Recovery: once the storm has drained, a light wave ({p.get('light_wave_requests', '?')} new "
        f"requests, well inside the pool) on the same engine ran at {_f(after, 1)} tok/s, against "
        f"{_f(fresh, 1)} tok/s on a fresh engine with the same pool (means of two runs each, "
        f"alternating; ratio {_f(after / fresh, 3)}; target >= 0.95).",
        "",
    ]
    return "\n".join(lines)


def _reference(p: dict) -> str:
    runs = p.get("unconstrained_runs_tok_s")
    if not runs:
        return "."
    listed = ", ".join(_f(t, 1) for t in runs)
    if p.get("method") != "side by side":
        return (f" (mean of {len(runs)} runs, one before the first storm and one after each: {listed}; "
                f"each storm is compared with the two around it).")
    null = p.get("null_ratios") or []
    return (f" (mean of {len(runs)} runs: {listed}). Each storm ran side by side with an unconstrained "
            f"run of the same requests, the two engines stepped in turn so that both went through the "
            f"same seconds of this host, each timed by its own steps; the unconstrained run beside "
            f"itself read {', '.join(_f(x, 3) for x in null)} (the method's own error).")

