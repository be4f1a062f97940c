"""The `folio` command: `serve` (OpenAI-compatible server), `generate` (batch completions), `chat` (terminal chat),
`bench` (throughput, serving latency, the Transformers baseline, the roofline, random-weight test models).

Engine options are defined once, in folio.config; `_engine_options` makes their flags, shared by every subcommand
that runs the engine through argparse parents. The server's own options (limits, backpressure, shutdown) are
defined the same way in folio.entrypoints.openai.server_options, and `serve` gets their flags from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from typing import Any, Optional, Sequence

from folio import envs
from folio.bench import baseline, make_model, perplexity, roofline, serve, throughput
from folio.config import EngineConfig, engine_options
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.entrypoints.llm import LLM
from folio.entrypoints.openai.server_options import ServerOptions
from folio.sampling_params import SamplingParams


def _engine_options() -> argparse.ArgumentParser:
    """A flag for every engine option, made from its definition in folio.config: defaults live there alone
    (a flag left out is not passed)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("engine options")
    for _, option, option_type in engine_options():
        _add_flag(group, option, option_type)
    return parser


def _add_flag(group: argparse._ArgumentGroup, option: dataclasses.Field, option_type: Any) -> None:
    group.add_argument(f"--{option.name.replace('_', '-')}", help=_flag_help(option),
                       **_flag_kwargs(option, option_type))


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    types = typing.get_type_hints(ServerOptions)
    for option in dataclasses.fields(ServerOptions):
        _add_flag(group, option, types[option.name])


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The server options given as flags; the rest keep their defaults."""
    return ServerOptions(**{option.name: getattr(args, option.name) for option in dataclasses.fields(ServerOptions)
                            if getattr(args, option.name, None) is not None})


def _flag_help(option: dataclasses.Field) -> str:
    """The definition's help and its default, a bool shown as on/off; % escaped for argparse's formatting."""
    default = option.metadata["default_means"] or option.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    return f"{option.metadata['help']} (default: {default})".replace("%", "%%")


def _flag_kwargs(option: dataclasses.Field, option_type: Any) -> dict[str, Any]:
    """argparse keywords: the definition's own, else what the field's type implies (bool: --x/--no-x)."""
    kwargs = dict(option.metadata["cli"])
    if kwargs.keys() & {"type", "action"}:
        return kwargs
    types = [t for t in typing.get_args(option_type) or (option_type,) if t is not type(None)]
    if types == [bool]:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif types in ([int], [float]):
        kwargs["type"] = types[0]
    return kwargs  # anything else is taken as the string given


def _sampling_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens per completion (default: 256)")
    group.add_argument("--temperature", type=float, help="0 = greedy (default: 1.0)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass (default: 1.0)")
    group.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default: all)")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given as flags, by their flat names."""
    return {option.name: getattr(args, option.name) for _, option, _ in engine_options()
            if getattr(args, option.name, None) is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs(args))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    return SamplingParams(max_tokens=args.max_tokens, **{k: v for k, v in given.items() if v is not None})


def build_parser() -> argparse.ArgumentParser:
    engine, sampling = _engine_options(), _sampling_options()
    parser = argparse.ArgumentParser(prog="folio", description="LLM inference and serving engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", parents=[engine], help="run the OpenAI-compatible server",
                                description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                            "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                                            "/version, /metrics).")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 "
                                                           "for all interfaces)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000; 0 picks a free port")
    serve.add_argument("--api-key", default=envs.api_key(),
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                            "$FOLIO_API_KEY, else no key)")
    serve.add_argument("--served-model-name", help="the model's name in the API (default: the model path, or "
                                                   "SmolLM2-135M-Instruct for the embedded model)")
    _add_server_options(serve)
    serve.set_defaults(run=_serve)

    generate = commands.add_parser("generate", parents=[engine, sampling], help="complete prompts and print them",
                                   description="Complete prompts given as arguments, in a file (--file, one per "
                                               "line) or on stdin (one per line), as one batch.")
    generate.add_argument("prompts", nargs="*", metavar="PROMPT")
    generate.add_argument("--file", help="read prompts from this file, one per line")
    generate.set_defaults(run=_generate)

    chat = commands.add_parser("chat", parents=[engine, sampling], help="chat with a model in the terminal",
                               description="Interactive chat through the model's chat template, streaming the "
                                           "reply. /exit or end of input (Ctrl-D) quits.")
    chat.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    chat.add_argument("--system", help="system prompt")
    chat.set_defaults(run=_chat)
    _add_bench(commands, engine)
    return parser


def _add_bench(commands: argparse._SubParsersAction, engine: argparse.ArgumentParser) -> None:
    """`folio bench NAME`: each benchmark module brings add_arguments and main; those that run the engine take
    the engine flags and get main(args, EngineConfig)."""
    bench = commands.add_parser("bench", help="benchmarks: throughput, serve, baseline, roofline, perplexity, make-model",
                                description="Benchmarks. Timings on a shared CPU are noisy: compare the ratios "
                                            "each benchmark measures side by side in one run.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module, uses_engine, summary in (
            ("throughput", throughput, True, "offline throughput and the step-time breakdown"),
            ("serve", serve, False, "latency and throughput of an OpenAI-compatible server under load"),
            ("baseline", baseline, True, "folio against Hugging Face Transformers on the same workload"),
            ("roofline", roofline, True, "this machine's limits and the fastest the workload could run"),
            ("perplexity", perplexity, True, "perplexity over a text: the accuracy of quantisation and 8-bit KV"),
            ("make-model", make_model, False, "write a random-weight model folder of a named architecture")):
        parser = benchmarks.add_parser(name, parents=[engine] if uses_engine else [], help=summary,
                                       description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        if uses_engine:
            parser.set_defaults(run=lambda args, main=module.main: main(args, engine_config(args)))
        else:
            parser.set_defaults(run=module.main)


def _with_model_arg(args: argparse.Namespace) -> argparse.Namespace:
    if getattr(args, "model_arg", None) is not None:
        if args.model is not None and args.model != args.model_arg:
            raise SystemExit(f"folio {args.command}: give the model once, as MODEL or --model")
        args.model = args.model_arg
    return args


def _serve(args: argparse.Namespace) -> int:
    from folio.entrypoints.openai.server import run_server  # fastapi and uvicorn only for the server

    return run_server(engine_config(args), args.host, args.port, args.api_key, args.served_model_name,
                      server_options(args))


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    elif sys.stdin.isatty():
        raise SystemExit("folio generate: give prompts as arguments, with --file, or on stdin")
    else:
        lines = sys.stdin.read().splitlines()
    return [line for line in lines if line.strip()]


def _generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    if not prompts:
        raise SystemExit("folio generate: no prompts")
    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(prompts, sampling_params(args))
    for prompt, output in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"==> {prompt} <==")
        print(output.outputs[0].text, flush=True)
    return 0


def _chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    tokenizer = engine.get_tokenizer()
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        request_id = engine.next_request_id()
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            engine.add_request(request_id, {"prompt_token_ids": ids}, params, output_kind=OutputKind.DELTA)
        except ValueError as e:  # e.g. the conversation outgrew the context: this turn is dropped
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        reply = []
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    text = output.outputs[0].text if output.outputs else ""
                    reply.append(text)
                    print(text, end="", flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            engine.abort_request(request_id)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _with_model_arg(build_parser().parse_args(argv))
    if args.command != "serve" and envs.logging_level() is None:
        logging.getLogger("folio").setLevel(logging.WARNING)  # the terminal is for their output, not start-up facts
    try:
        return args.run(args)
    except (ValueError, OSError) as e:  # bad options, a missing model, a port in use: no traceback
        name = " ".join(filter(None, (args.command, getattr(args, "benchmark", None))))
        print(f"folio {name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
