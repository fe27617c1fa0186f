"""The `stopline` command: one function per subcommand, registered in `main`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from stopline.args import add_engine_args, engine_config
from stopline.extras import MissingExtra, as_missing_extra, require

Command = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
Registry = list[tuple[str, str, Configure, Command]]
_COMMANDS: Registry = []  # stopline NAME


def _registrar(registry: Registry, doc: str) -> Callable[[str, str, Configure], Callable[[Command], Command]]:
    def register(name: str, help: str, configure: Configure) -> Callable[[Command], Command]:
        def wrap(fn: Command) -> Command:
            registry.append((name, help, configure, fn))
            return fn
        return wrap
    register.__doc__ = doc
    return register


command = _registrar(_COMMANDS, "Register a subcommand (decorator); each lives in its own function.")


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
    g.add_argument("--lora", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve as models NAME (PEFT directories or llama.cpp GGUF "
                        "LoRA files); more load at run time with POST /v1/load_lora_adapter")
    g.add_argument("--lora-unload-policy", default="wait", choices=["wait", "abort", "refuse"],
                   help="what an unload does to requests using the adapter when the body names no "
                        "policy: let them finish (wait), end them (abort), or refuse with 409")
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
    g.add_argument("--disagg-restarts", type=int, default=5,
                   help="with --disagg: a local role that dies is restarted; after this many "
                        "deaths within 300 s it stays dead (503) (0: never restart)")
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
    g.add_argument("--restart-core", type=int, default=0, metavar="N",
                   help="restart the engine-core process when it dies (or is killed for being "
                        "stuck): its open requests end with an error, new ones are served once "
                        "it is back; after N deaths within 300 s it stays dead and the server "
                        "exits (0: never restart, the server exits at the first death)")
    g.add_argument("--standby-core", action="store_true",
                   help="with --restart-core: keep a second engine-core process loaded and asleep "
                        "(its KV pool freed); when the core dies it is woken and serves at once, "
                        "and another is loaded in the background (costs the model's weights and "
                        "a process's memory once more)")
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
    g.add_argument("--paused-admission", choices=["queue", "reject"], default="queue",
                   help="while paused or asleep (POST /pause, /sleep), new requests wait for the "
                        "resume (at most --queue-timeout) or get 503 with Retry-After")
    g.add_argument("--update-recompute", action="store_true",
                   help="POST /update_weights (mode keep): recompute the in-flight requests' KV under "
                        "the new weights (preempt them by recompute at the swap); a body's "
                        "`recompute` decides for its own update")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    g.add_argument("--reasoning-parser", default="auto",
                   help="the markers of the model's thinking: 'auto' (the pair its chat template "
                        "writes, <think>...</think>), 'none' (no thinking), or 'START,END'")
    g.add_argument("--responses-max-stored", type=int, default=1000,
                   help="/v1/responses: stored responses kept at most, oldest ended first (also "
                        "the most background responses running at once)")
    g.add_argument("--responses-ttl-s", type=float, default=3600.0,
                   help="/v1/responses: seconds a stored response is kept after it ended")
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


def _loras(specs: list[str]) -> dict[str, str]:
    """--lora NAME=PATH ... as {name: path}."""
    out: dict[str, str] = {}
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise SystemExit(f"--lora: expected NAME=PATH, got {spec!r}")
        if name in out:
            raise SystemExit(f"--lora: {name!r} given twice")
        out[name] = path
    return out


@command("serve", "OpenAI-compatible HTTP server (engine core in its own process)", _serve_args)
def serve(args: argparse.Namespace) -> int:
    from stopline.server.reasoning import markers
    from stopline.server.run import serve as run_server
    from stopline.server.state import ServerSettings

    try:
        markers(args.reasoning_parser, None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    settings = ServerSettings(
        model_name=args.served_model_name or served_model_name(args.model), api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, queue_timeout=args.queue_timeout,
        drain_timeout=args.drain_timeout, reasoning_parser=args.reasoning_parser,
        paused_admission=args.paused_admission, update_recompute=args.update_recompute,
        responses_max_stored=args.responses_max_stored,
        responses_ttl_s=args.responses_ttl_s, loras=_loras(args.lora),
        lora_unload_policy=args.lora_unload_policy)
    if args.responses_max_stored < 1 or args.responses_ttl_s <= 0:
        raise SystemExit("--responses-max-stored must be at least 1 and --responses-ttl-s above 0")
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
    if args.restart_core and (args.replicas is not None or args.disagg or args.in_process):
        raise SystemExit("--restart-core is for the one engine-core process: replicas and the "
                         "split's roles restart their own, and --in-process has no process")
    if args.restart_core < 0:
        raise SystemExit(f"--restart-core must be >= 0, got {args.restart_core}")
    if args.standby_core and not args.restart_core:
        raise SystemExit("--standby-core needs --restart-core N (the standby replaces a core that died)")
    if args.replicas is not None:
        require("ray", what="--replicas")  # before anything starts, so nothing needs undoing
        from stopline.cluster.frontend import ray_engine

        engine = ray_engine(args.model, engine_config(args), replicas=args.replicas,
                            address=args.ray_address, policy=args.route,
                            threads=args.core_threads or 1, liveness=liveness,
                            max_waiting=args.max_waiting,
                            stall_timeout=args.stall_timeout, max_buffered=args.max_buffered)
    elif args.disagg:
        from stopline.disagg.frontend import Restarts, disagg_engine

        try:
            restarts = Restarts(limit=args.disagg_restarts)
        except ValueError as exc:
            raise SystemExit(f"--disagg-restarts: {exc}") from None
        engine = disagg_engine(args.model, engine_config(args), reclaim_s=args.reclaim_s,
                               threads=args.core_threads, remote=args.disagg_remote,
                               listen=args.disagg_listen, liveness=liveness, restarts=restarts,
                               max_waiting=args.max_waiting,
                               stall_timeout=args.stall_timeout, max_buffered=args.max_buffered)
    elif args.restart_core:
        from stopline.engine.liveness import Restarts
        from stopline.engine.proc.restart import restarting_engine

        engine = restarting_engine(args.model, engine_config(args), core_threads=args.core_threads,
                                   liveness=liveness, restarts=Restarts(limit=args.restart_core),
                                   standby=args.standby_core,
                                   max_waiting=args.max_waiting, stall_timeout=args.stall_timeout,
                                   max_buffered=args.max_buffered)
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


# stopline bench NAME: (name, help, module). Each benchmark module owns its flags and its run,
# `configure(p: ArgumentParser) -> None` and `main(args: Namespace) -> int`; it is imported only
# when its own parser is used, so no other command loads a benchmark, and one benchmark's
# imports can't break another's parser (the base install builds every one: test_dependencies).
_BENCHES: list[tuple[str, str, str]] = [
    ("stop", "cost of stopping: cancel storm and preemption storm (in-process)", "stopline.bench.stop"),
    ("pause", "engine-wide pause with N streams in flight: time to pause and to resume, tokens "
     "discarded, per mode (abort, keep, wait)", "stopline.bench.pause"),
    ("replicas", "Ray replicas: abort latency through the router, routing overhead, prefix hit rate, "
     "head-of-line, replica kill (run it in a network namespace)", "stopline.bench.replicas"),
    ("disagg", "prefill/decode split: head-of-line after cancelled long prompts, cancel-to-reclaim on "
     "both sides, KV transfer MB/s and share of TTFT", "stopline.bench.disagg"),
    ("serve", "serving benchmark over the OpenAI HTTP API: stopline vs vLLM, llama.cpp, HF",
     "stopline.bench.serve_cli"),
    ("serve-report", "render docs/benchmarks.md from `bench serve` results", "stopline.bench.report"),
    ("grammar", "structured output served: N json_schema streams vs N unstructured, throughput ratio "
     "and mask time", "stopline.bench.grammar"),
    ("lora", "LoRA adapters served: N streams under 4 adapters vs base only (ratio), unload latency "
     "under load (abort and wait)", "stopline.bench.lora"),
    ("spec", "speculative decoding off / on / auto: one repetitive stream, one free, N streams",
     "stopline.bench.spec"),
    ("offline", "offline tokens/s, 1 and N streams, next to HF transformers generate", "stopline.bench.offline"),
    ("marathon", "the server under steady and burst load with client cancels while its engine "
     "processes are paused and killed: canaries exact, recovery time, pool and RSS over time, "
     "log scan", "stopline.bench.marathon"),
    ("soak", "server memory over many requests, half closed early: RSS bytes per request", "stopline.bench.soak"),
    ("neighbours", "decode step time quiet and beside a process taking a slice of our CPUs "
     "(phases alternate; --no-adapt-threads for the A/B)", "stopline.bench.neighbours"),
    ("floors", "host floors (read bandwidth, GEMM rates) and decode step time against them, per "
     "numerics mode; --accuracy: fast vs exact under teacher forcing", "stopline.bench.floors"),
]


class _BenchParser(argparse.ArgumentParser):
    """The parser of one `stopline bench NAME`: its module configures it on first use."""

    def __init__(self, *args: Any, module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse hands the chosen subparser its arguments here: configure it first, once."""
        if self._module:
            import importlib

            mod, self._module = importlib.import_module(self._module), ""
            mod.configure(self)
            self.set_defaults(bench_func=mod.main)
        return super().parse_known_args(args, namespace)


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, parser_class=_BenchParser)
    for name, help_, module in _BENCHES:
        sub.add_parser(name, help=help_, module=module)


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
    what = " ".join(filter(None, ["stopline", args.command, getattr(args, "bench", None)]))
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:  # an optional package a command imports when it runs
        missing = as_missing_extra(exc, what)
        if missing is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
