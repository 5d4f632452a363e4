"""`shardserve` command line. Errors a user can fix print one line and exit 2, no traceback."""
from __future__ import annotations

import argparse
import sys
import uuid

from shardserve.engine.cli_args import add_engine_args, engine_kwargs
from shardserve.server.auth import add_auth_args, add_tls_args


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from shardserve.engine.launcher import build_engine
    from shardserve.llm import engine_config_from_kwargs
    from shardserve.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    engine = build_engine(engine_config_from_kwargs(args.model, **engine_kwargs(args)))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request(uuid.uuid4().hex, prompt, params)
    if not args.chat:
        print(args.prompt, end="", flush=True)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
        print()
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from shardserve.config import ServerConfig, serving_token_budget
    from shardserve.llm import engine_config_from_kwargs
    from shardserve.server.auth import auth_from_args, tls_from_args
    from shardserve.server.serve import run_server

    model = args.model_pos or args.model
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = serving_token_budget(args.device == "cpu")
    if args.prefault_kv_cache is None:  # a server holds its KV budget anyway: commit it before /health
        args.prefault_kv_cache = args.device == "cpu"
    server = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                          max_waiting_requests=args.max_waiting_requests, max_request_bytes=args.max_request_bytes,
                          log_level=args.log_level, tool_call_parser=args.tool_call_parser, **tls_from_args(args),
                          calibration=args.calibration, device_price_per_hour_usd=args.device_price_per_hour)
    return run_server(engine_config_from_kwargs(model, **engine_kwargs(args)), server, auth_from_args(args))


def cmd_route(args: argparse.Namespace) -> int:
    from shardserve.config import RouterConfig
    from shardserve.router.policies import make_policy
    from shardserve.router.serve import run_router
    from shardserve.server.auth import auth_from_args, tls_from_args

    make_policy(args.policy)  # an unknown policy fails here, in one line
    config = RouterConfig(
        replicas=tuple(args.replica), policy=args.policy, host=args.host, port=args.port,
        max_outstanding_per_replica=args.max_outstanding_per_replica, probe_interval_s=args.probe_interval,
        probe_timeout_s=args.probe_timeout, batch_capacity_fraction=args.batch_capacity_fraction,
        eject_after_failures=args.eject_after_failures, stall_timeout_s=args.stall_timeout,
        max_attempts=args.max_attempts, max_request_bytes=args.max_request_bytes, log_level=args.log_level,
        **tls_from_args(args),
    )
    return run_router(config, auth_from_args(args))


def add_route_parser(sub) -> None:
    route = sub.add_parser("route", help="an OpenAI-compatible gateway over several replicas")
    route.add_argument("--replica", action="append", default=[], metavar="URL",
                       help="a replica's base URL (repeat; more can be added at /admin/replicas)")
    route.add_argument("--policy", default="least_outstanding",
                       help="round_robin | least_outstanding | power_of_two | prefix_aware")
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=8080)
    route.add_argument("--max-outstanding-per-replica", type=int, default=64,
                       help="in-flight requests that saturate a replica; with all saturated, answer 429")
    route.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes")
    route.add_argument("--probe-timeout", type=float, default=5.0, help="seconds a health probe may take")
    route.add_argument("--eject-after-failures", type=int, default=3,
                       help="consecutive failed probes or requests that eject a replica")
    route.add_argument("--batch-capacity-fraction", type=float, default=0.5,
                       help="batch-class requests are admitted only below this share of the fleet's capacity")
    route.add_argument("--stall-timeout", type=float, default=10.0,
                       help="seconds without an event or a progress comment after which a stream moves to another replica")
    route.add_argument("--max-attempts", type=int, default=4, help="replicas one request may try")
    route.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get HTTP 413")
    route.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_auth_args(route)
    add_tls_args(route)
    route.set_defaults(func=cmd_route)


def read_config_file(argv: list[str] | None) -> dict:
    """Values of `shardserve serve --config FILE.yaml` (keys are flag names, dashes or
    underscores), or {}. Other commands' --config files are their own business."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config or known.command != "serve":
        return {}
    import yaml

    from shardserve.config import ConfigError

    try:
        with open(known.config) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {known.config}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {known.config} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def build_parser(serve_defaults: dict | None = None) -> argparse.ArgumentParser:
    """The CLI; `serve_defaults` (from a config file) replace the serve flags' defaults, so flags
    given on the command line still win."""
    parser = argparse.ArgumentParser(prog="shardserve", description="distributed LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="unscheduled requests beyond this get HTTP 429")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get HTTP 413")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json", "mistral"],
                       help="the model's tool-call format: how tools are shown to it and its calls read back")
    serve.add_argument("--calibration", default=None, metavar="FILE",
                       help="`shardserve profile`'s calibration.json: device peaks for the live MFU/MBU metrics")
    serve.add_argument("--device-price-per-hour", type=float, default=None, metavar="USD",
                       help="price of one device-hour, for shardserve:cost_per_million_tokens_usd "
                            "(default: the calibration's, else 0)")
    serve.add_argument("--config", help="YAML file of flag values; command-line flags override it")
    add_auth_args(serve)
    add_tls_args(serve)
    serve.set_defaults(func=cmd_serve)

    from shardserve.bench.cli_args import add_bench_parser

    add_bench_parser(sub)
    from shardserve.planner.cli_args import add_plan_parser

    add_plan_parser(sub)
    from shardserve.sim.cli_args import add_simulate_parser

    add_simulate_parser(sub)
    from shardserve.profiler.cli_args import add_profile_parser

    add_profile_parser(sub)
    add_route_parser(sub)
    from shardserve.cluster.cli_args import add_cluster_parser

    add_cluster_parser(sub)
    if serve_defaults:
        from shardserve.config import ConfigError

        unknown = sorted(set(serve_defaults) - set(vars(serve.parse_args([]))))
        if unknown:
            raise ConfigError(f"config file: unknown keys {', '.join(unknown)}")
        serve.set_defaults(**serve_defaults)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shardserve.config import ConfigError
    from shardserve.request import InvalidRequestError

    try:
        args = build_parser(read_config_file(argv)).parse_args(argv)
        return args.func(args)
    except (ConfigError, InvalidRequestError) as exc:
        print(f"shardserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
