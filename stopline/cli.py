"""The `stopline` command: one function per subcommand, registered in `main`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
Registry = list[tuple[str, str, Configure, Command]]
_COMMANDS: Registry = []  # stopline NAME
_BENCHES: Registry = []  # stopline bench NAME


def _registrar(registry: Registry, doc: str) -> Callable[[str, str, Configure], Callable[[Command], Command]]:
    def register(name: str, help: str, configure: Configure) -> Callable[[Command], Command]:
        def wrap(fn: Command) -> Command:
            registry.append((name, help, configure, fn))
            return fn
        return wrap
    register.__doc__ = doc
    return register


command = _registrar(_COMMANDS, "Register a subcommand (decorator); each lives in its own function.")
bench_command = _registrar(_BENCHES, "Register `stopline bench NAME` (decorator), like `command`.")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine settings shared by every command that builds an engine."""
    from stopline.config import (
        ATTENTION_BACKENDS,
        LINEAR_BACKENDS,
        EngineConfig,
        PreemptionMode,
        VictimPolicy,
    )

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size in GiB")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-gb)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--preemption-mode", default=EngineConfig.preemption_mode.value,
                   choices=[m.value for m in PreemptionMode],
                   help="how a preempted request gets back its KV: recompute, swap (a host copy), or "
                        "auto (whichever costs less, measured)")
    g.add_argument("--victim-policy", default="cost", choices=[v.value for v in VictimPolicy])
    g.add_argument("--admission-lookahead", type=int, default=EngineConfig.admission_lookahead,
                   help="tokens of growth kept free for each running request when admitting new "
                        "ones (0: admit into any free room)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--grammar-deadline", type=float, default=EngineConfig.grammar_deadline,
                   help="seconds a structured-output request may wait for its grammar to compile")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention through stopline's C kernel, reading the paged KV cache in place "
                        "(native), or torch's ops (torch); auto: native where it runs")
    g.add_argument("--adapt-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="run small decode steps on one thread fewer while other processes take "
                        "at least 0.4 of a core of ours (only steps whose kernels are all "
                        "stopline's, so no token changes)")
    g.add_argument("--decode-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="with torch attention: decoding sequences keep a contiguous copy of their "
                        "K/V (up to twice the KV pool's memory) instead of gathering their blocks "
                        "every step")
    g.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                   help="GEMM library of the linear layers on CPU (auto: oneDNN for the large "
                        "weights, BLAS for the small ones)")
    g.add_argument("--speculative", default=EngineConfig.speculative.value, choices=["off", "on", "auto"],
                   help="speculative decoding by n-gram lookup over each request's own tokens, lossless "
                        "to the bit; auto: only where measured acceptance and step costs say it pays")
    g.add_argument("--speculative-tokens", type=int, default=EngineConfig.speculative_tokens,
                   help="most draft tokens a request verifies in one step")
    g.add_argument("--quant-max-rows", type=int, default=EngineConfig.quant_max_rows,
                   help="batches of up to this many rows read a GGUF's Q4_1/Q8_0 weights in their "
                        "blocks through stopline's C kernel (same bits as float32; 0: never)")
    g.add_argument("--numerics", default=EngineConfig.numerics.value, choices=["exact", "fast"],
                   help="linear layers in float32 bits (exact) or bf16 inputs with fp32 sums on "
                        "AVX512-BF16 (fast); both batch-invariant (docs/numerics.md)")


def engine_config(args: argparse.Namespace):
    from stopline.config import EngineConfig

    return EngineConfig(
        kv_cache_memory_gb=args.kv_cache_gb, num_blocks=args.num_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, victim_policy=args.victim_policy,
        admission_lookahead=args.admission_lookahead,
        async_scheduling=args.async_scheduling, enable_prefix_caching=not args.no_prefix_caching,
        grammar_deadline=args.grammar_deadline,
        attention_backend=args.attention_backend, decode_rows=args.decode_rows,
        adapt_threads=args.adapt_threads,
        linear_backend=args.linear_backend,
        quant_max_rows=args.quant_max_rows, numerics=getattr(args, "numerics", "exact"),
        speculative=args.speculative, speculative_tokens=args.speculative_tokens,
    )


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (a user message, unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)


@command("generate", "generate text for one prompt, streamed to the terminal", _generate_args)
def generate(args: argparse.Namespace) -> int:
    from stopline.engine.llm import LLM
    from stopline.request import InvalidRequest, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, config=engine_config(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)

    def show(out) -> None:
        sys.stdout.write(out.new_text)
        sys.stdout.flush()

    t1 = time.perf_counter()
    try:
        if args.raw:
            res = llm.generate(args.prompt, params, on_output=show)
        else:
            res = llm.chat([{"role": "user", "content": args.prompt}], params, on_output=show)
    except InvalidRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t1
    c = res[0].outputs[0]
    print(file=sys.stdout)
    print(f"[{len(c.token_ids)} tokens in {gen_s:.2f}s, {len(c.token_ids) / max(gen_s, 1e-9):.1f} tok/s; "
          f"finish_reason={c.finish_reason.value if c.finish_reason else None}; "
          f"model loaded in {load_s:.1f}s]", file=sys.stderr)
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model file or directory name)")
    g.add_argument("--in-process", action="store_true",
                   help="run the engine core in a thread of the server process instead of its own process")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve through N engine replicas, Ray actors (docs/replicas.md)")
    g.add_argument("--ray-address", default=None,
                   help="with --replicas: an existing Ray cluster (default: start a local one)")
    g.add_argument("--route", default="affinity", choices=["affinity", "round-robin"],
                   help="with --replicas: least loaded with prefix affinity, or round robin")
    g.add_argument("--disagg", action="store_true",
                   help="prefill and decode engines as two processes behind this front end (docs/disagg.md)")
    g.add_argument("--reclaim-s", type=float, default=3.0,
                   help="with --disagg: seconds a KV transfer may wait for the other side before "
                        "its blocks are freed and its request ends with an error")
    g.add_argument("--disagg-remote", default=None, choices=["prefill", "decode"],
                   help="with --disagg: this role runs on another host (`stopline role ROLE "
                        "--front HOST:PORT` there); the other runs here")
    g.add_argument("--disagg-listen", default="127.0.0.1:7100",
                   help="with --disagg-remote: host:port P of this host the remote role connects "
                        "to (ports P..P+4; use an address the other host reaches)")
    g.add_argument("--stuck-s", type=float, default=5.0,
                   help="seconds an engine process (core, role, replica) may leave a heartbeat "
                        "unanswered or stay in one step before it is marked stuck: no new work, "
                        "its requests' cancels confirmed by the front end")
    g.add_argument("--stuck-kill-s", type=float, default=60.0,
                   help="seconds of the same before a stuck engine process is killed (a replica "
                        "is then restarted)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="answer 429 while this many requests wait for their first step (default: no limit)")
    g.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request may wait before its first step, else 503 (default: no limit)")
    g.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds a streaming client may read nothing while its stream is full "
                        "before its request is aborted (source 'stalled')")
    g.add_argument("--max-buffered", type=int, default=64,
                   help="outputs a stream holds unread before its request is paused")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds open requests may run before they are aborted")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    g.add_argument("--core-threads", type=int, default=None,
                   help="torch threads in the engine-core process (default: all CPUs but one "
                        "when there are more than two, so aborts are taken in at once)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    add_engine_args(p)


def served_model_name(model: str | None) -> str:
    from pathlib import Path

    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


@command("serve", "OpenAI-compatible HTTP server (engine core in its own process)", _serve_args)
def serve(args: argparse.Namespace) -> int:
    from stopline.server.run import serve as run_server
    from stopline.server.state import ServerSettings

    settings = ServerSettings(
        model_name=args.served_model_name or served_model_name(args.model), api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, queue_timeout=args.queue_timeout,
        drain_timeout=args.drain_timeout)
    engine = None
    if args.disagg and (args.replicas is not None or args.in_process):
        raise SystemExit("--disagg runs its own two engine processes: it does not combine with "
                         "--replicas or --in-process")
    if args.disagg_remote is not None and not args.disagg:
        raise SystemExit("--disagg-remote needs --disagg")
    from stopline.engine.liveness import Bounds

    try:
        liveness = Bounds(args.stuck_s, args.stuck_kill_s)
    except ValueError as exc:
        raise SystemExit(f"--stuck-s and --stuck-kill-s: {exc}") from None
    if args.replicas is not None:
        from stopline.cluster.frontend import ray_engine

        engine = ray_engine(args.model, engine_config(args), replicas=args.replicas,
                            address=args.ray_address, policy=args.route,
                            threads=args.core_threads or 1, liveness=liveness,
                            max_waiting=args.max_waiting,
                            stall_timeout=args.stall_timeout, max_buffered=args.max_buffered)
    elif args.disagg:
        from stopline.disagg.frontend import disagg_engine

        engine = disagg_engine(args.model, engine_config(args), reclaim_s=args.reclaim_s,
                               threads=args.core_threads, remote=args.disagg_remote,
                               listen=args.disagg_listen, liveness=liveness,
                               max_waiting=args.max_waiting,
                               stall_timeout=args.stall_timeout, max_buffered=args.max_buffered)
    return run_server(args.model, engine_config(args), settings, host=args.host, port=args.port,
                      engine=engine, liveness=liveness,
                      in_process=args.in_process, max_waiting=args.max_waiting,
                      core_threads=args.core_threads, stall_timeout=args.stall_timeout,
                      max_buffered=args.max_buffered, log_level=args.log_level,
                      access_log=args.access_log)


def _role_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--front", required=True,
                   help="host:port the front end listens on for this role (its --disagg-listen)")
    p.add_argument("--reclaim-s", type=float, default=3.0,
                   help="seconds a KV transfer may wait for the other side (as the front end's)")
    p.add_argument("--core-threads", type=int, default=None,
                   help="torch threads (default: all CPUs but one when there are more than two)")
    add_engine_args(p)


@command("role", "one engine of a split serve, on this host, for `serve --disagg --disagg-remote "
         "ROLE` on another (docs/disagg.md)", _role_args)
def role(args: argparse.Namespace) -> int:
    import dataclasses

    from stopline.disagg.frontend import remote_spec
    from stopline.disagg.role import RoleFactory
    from stopline.engine.proc import core_proc
    from stopline.engine.proc.remote import core_addresses

    if not args.reclaim_s > 0:
        raise SystemExit(f"--reclaim-s must be > 0, got {args.reclaim_s}")
    try:
        addrs = core_addresses(args.front)
    except ValueError as exc:
        raise SystemExit(f"--front: {exc}") from None
    cfg = engine_config(args)
    if args.role == "decode":  # received KV enters its prefix cache
        cfg = dataclasses.replace(cfg, enable_prefix_caching=True)
    factory = RoleFactory(remote_spec(args.role, args.front, args.reclaim_s))
    core_proc.main(addrs, args.model, cfg, True, None, args.core_threads, factory)
    return 0  # not reached: main leaves with os._exit


def _stop_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="cancel storm size (half are aborted)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--storm-requests", type=int, default=32, help="preemption storm size")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / demand in the storm")
    p.add_argument("--combos", default="recompute:cost,recompute:newest,recompute:fewest-output,"
                   "recompute:longest-output,recompute:least-computed,swap:cost,auto:cost",
                   help="comma-separated mode:policy pairs for the preemption storm")
    p.add_argument("--storm-rounds", type=int, default=2,
                   help="runs of each preemption-storm pair (one per round; the ratio is their mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/stop.json")
    p.add_argument("--report", default="docs/stop-benchmark.md")
    add_engine_args(p)


@bench_command("stop", "cost of stopping: cancel storm and preemption storm (in-process)", _stop_bench_args)
def bench_stop(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stopline.bench import stop, stop_report
    from stopline.model.loaders.loader import load_model

    loaded = load_model(args.model)
    combos = [tuple(c.split(":", 1)) for c in args.combos.split(",") if c]
    if args.storm_rounds < 1:
        raise SystemExit(f"--storm-rounds must be >= 1, got {args.storm_rounds}")
    result = stop.run(loaded, Path(args.out), args.requests, args.max_tokens, args.storm_requests,
                      args.pool_fraction, args.seed, combos, engine_config(args), args.storm_rounds)
    result["command"] = "stopline bench stop " + " ".join(sys.argv[3:])
    Path(args.out).write_text(__import__("json").dumps(result, indent=2))
    Path(args.report).write_text(stop_report.render(result))
    print(f"results: {args.out}; report: {args.report}")
    return 0


def _replicas_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=40, help="aborts timed per engine")
    p.add_argument("--long-len", type=int, default=512, help="prompt tokens of the cancelled long prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/replicas.json")
    add_engine_args(p)


@bench_command("replicas", "Ray replicas: abort latency through the router, routing overhead, "
               "prefix hit rate, head-of-line, replica kill (run it in a network namespace)",
               _replicas_bench_args)
def bench_replicas(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from stopline.bench import replicas
    from stopline.cluster.frontend import quiet_ray_env

    quiet_ray_env()
    result = replicas.run(args.model, engine_config(args), args.rounds, args.long_len, args.seed)
    command = "stopline bench replicas " + " ".join(sys.argv[3:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(replicas.render(result, command, args.model or "SmolLM2-135M-Instruct"))
    return 0


def _disagg_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="rounds of each measure (medians reported)")
    p.add_argument("--long-len", type=int, default=1500, help="prompt tokens of the long prompts")
    p.add_argument("--reclaim-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/disagg.json")
    add_engine_args(p)


@bench_command("disagg", "prefill/decode split: head-of-line after cancelled long prompts, "
               "cancel-to-reclaim on both sides, KV transfer MB/s and share of TTFT", _disagg_bench_args)
def bench_disagg(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from stopline.bench import disagg

    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    result = disagg.run(args.model, engine_config(args), args.rounds, args.long_len, args.seed, args.reclaim_s)
    command = "stopline bench disagg " + " ".join(sys.argv[3:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(disagg.render(result, command, args.model or "SmolLM2-135M-Instruct"))
    return 0


def _serve_bench_args(p: argparse.ArgumentParser) -> None:
    from stopline.bench.serve_cli import configure

    configure(p)


@bench_command("serve", "serving benchmark over the OpenAI HTTP API: stopline vs vLLM, llama.cpp, HF",
               _serve_bench_args)
def bench_serve(args: argparse.Namespace) -> int:
    from stopline.bench.serve_cli import run

    return run(args)


def _serve_report_args(p: argparse.ArgumentParser) -> None:
    from stopline.bench.serve_cli import configure_report

    configure_report(p)


@bench_command("serve-report", "render docs/benchmarks.md from `bench serve` results", _serve_report_args)
def bench_serve_report(args: argparse.Namespace) -> int:
    from stopline.bench.serve_cli import run_report

    return run_report(args)


def _grammar_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both phases (fastest counts)")
    p.add_argument("--serve-arg", action="append", default=[], help="passed to `stopline serve` (repeat)")


@bench_command("grammar", "structured output served: N json_schema streams vs N unstructured, "
               "throughput ratio and mask time", _grammar_bench_args)
def bench_grammar(args: argparse.Namespace) -> int:
    from stopline.bench import grammar

    result = grammar.run(args.streams, args.max_tokens, args.serve_arg, args.rounds)
    print("stopline bench grammar " + " ".join(sys.argv[3:]))
    print(grammar.table(result))
    return 0


def _spec_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the batch workload")
    p.add_argument("--max-tokens", type=int, default=192, help="new tokens of a single stream")
    p.add_argument("--batch-tokens", type=int, default=64, help="new tokens per stream of the batch")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every workload and mode (best counts)")
    p.add_argument("--out", default="bench_results/spec")
    add_engine_args(p)


@bench_command("spec", "speculative decoding off / on / auto: one repetitive stream, one free, N streams",
               _spec_bench_args)
def bench_spec(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stopline.bench import spec
    from stopline.model.loaders.loader import load_model

    result = spec.run(load_model(args.model), engine_config(args), args.streams, args.max_tokens,
                      args.batch_tokens, args.rounds)
    result["command"] = "stopline bench spec " + " ".join(sys.argv[3:])
    spec.write(result, Path(args.out))
    print(spec.table(result))
    return 0


def _offline_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="concurrent prompts in the batched run")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per request (EOS ignored)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    p.add_argument("--hf-cb", action="store_true",
                   help="also time HF transformers' continuous batching (generate_batch) on the N streams")
    p.add_argument("--hf-dir", default=None,
                   help="HF export of the model for transformers (default: exported to a temp dir)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench-results/offline.json")
    add_engine_args(p)


@bench_command("offline", "offline tokens/s, 1 and N streams, next to HF transformers generate",
               _offline_bench_args)
def bench_offline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stopline.bench import offline

    result = offline.run(args.model, engine_config(args), streams=args.streams,
                         max_tokens=args.max_tokens, hf=not args.no_hf,
                         hf_dir=Path(args.hf_dir) if args.hf_dir else None, threads=args.threads,
                         hf_cb=args.hf_cb)
    result["command"] = "stopline bench offline " + " ".join(sys.argv[3:])
    offline.write(result, Path(args.out))
    print(offline.summary(result))
    print(f"results: {args.out}")
    return 0


def _soak_bench_args(p: argparse.ArgumentParser) -> None:
    from stopline.bench.soak import configure

    configure(p)


@bench_command("soak", "server memory over many requests, half closed early: RSS bytes per request",
               _soak_bench_args)
def bench_soak(args: argparse.Namespace) -> int:
    from stopline.bench.soak import main

    return main(args)


def _neighbours_bench_args(p: argparse.ArgumentParser) -> None:
    from stopline.bench.neighbours import configure

    configure(p)
    p.add_argument("--out", default="bench-results/neighbours.json")


@bench_command("neighbours", "decode step time quiet and beside a process taking a slice of our CPUs "
               "(phases alternate; --no-adapt-threads for the A/B)", _neighbours_bench_args)
def bench_neighbours(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from stopline.bench import neighbours

    result = neighbours.run(args)
    result["command"] = "stopline bench neighbours " + " ".join(sys.argv[3:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(neighbours.summary(result))
    print(f"results: {out}")
    return 0


def _floors_bench_args(p: argparse.ArgumentParser) -> None:
    from stopline.bench.floors import configure

    configure(p)


@bench_command("floors", "host floors (read bandwidth, GEMM rates) and decode step time against them, "
               "per numerics mode; --accuracy: fast vs exact under teacher forcing", _floors_bench_args)
def bench_floors(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stopline.bench import floors

    if args.served:
        import signal

        # SIGTERM unwinds like Ctrl-C, so an engine --served started is stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = floors.run(args)
    result["command"] = "stopline bench floors " + " ".join(sys.argv[3:])
    floors.write(result, Path(args.out))
    print(floors.summary(result))
    print(f"results: {args.out}")
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, help_, configure, fn in _BENCHES:
        b = sub.add_parser(name, help=help_)
        configure(b)
        b.set_defaults(bench_func=fn)


@command("bench", "benchmarks (separate from the tests): stopline bench {stop,...}", _bench_args)
def bench(args: argparse.Namespace) -> int:
    return int(args.bench_func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stopline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_, configure, fn in _COMMANDS:
        p = sub.add_parser(name, help=help_)
        configure(p)
        p.set_defaults(func=fn)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
