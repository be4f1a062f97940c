"""The `folio` command: `serve` (OpenAI-compatible server), `generate` (batch completions), `chat` (terminal chat),
`bench` (throughput, serving latency, the Transformers baseline, the roofline, random-weight test models).

Engine options are defined once, in `_engine_options`, and shared by every subcommand through argparse parents;
a test checks that each EngineConfig field has its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from typing import Optional, Sequence, Union

from folio import envs
from folio.bench import baseline, make_model, roofline, serve, throughput
from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.entrypoints.llm import LLM
from folio.sampling_params import SamplingParams

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _memory(text: str) -> Union[int, float]:
    """'4GiB', '512M', '1000000' -> bytes; '0.3' -> a fraction of available memory."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 4GiB, 512MiB) or a fraction (e.g. 0.3), got {text!r}")
    number, unit = match.groups()
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _UNITS[unit])


def _engine_options() -> argparse.ArgumentParser:
    """Every EngineConfig field as a flag; defaults live in EngineConfig alone (a flag left out is not passed)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", help="Hugging Face model folder or .gguf file (default: the embedded "
                                       "SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (default: auto = bfloat16 where the CPU "
                                       "has fast bf16, else float32)")
    group.add_argument("--block-size", type=int, help="tokens per KV cache block (default: 16)")
    group.add_argument("--kv-cache-memory", type=_memory,
                       help="KV cache size: bytes (4GiB, 512MiB) or a fraction of available memory (0.3) "
                            "(default: the smaller of 4 GiB and 40%% of available memory)")
    group.add_argument("--max-num-seqs", type=int, help="most requests in a batch (default: 256)")
    group.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one step (default: 2048)")
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--scheduling-policy", choices=["fcfs", "priority"], help="default: fcfs")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       help="reuse the KV cache of earlier prompts' full blocks (default: on)")
    group.add_argument("--seed", type=int, help="random seed of the engine; for generate and chat also each "
                                                "request's sampling seed (default: 0, requests unseeded)")
    group.add_argument("--num-threads", type=int, help="torch threads (default: the cores this process may use)")
    return parser


def _sampling_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens per completion (default: 256)")
    group.add_argument("--temperature", type=float, help="0 = greedy (default: 1.0)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass (default: 1.0)")
    group.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default: all)")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    return EngineConfig(**given)


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
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds requests in flight get to finish before they are aborted "
                            "(default: 30)")
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
    bench = commands.add_parser("bench", help="benchmarks: throughput, serve, baseline, roofline, make-model",
                                description="Benchmarks. Timings on a shared CPU are noisy: compare the ratios "
                                            "each benchmark measures side by side in one run.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module, uses_engine, summary in (
            ("throughput", throughput, True, "offline throughput and the step-time breakdown"),
            ("serve", serve, False, "latency and throughput of an OpenAI-compatible server under load"),
            ("baseline", baseline, True, "folio against Hugging Face Transformers on the same workload"),
            ("roofline", roofline, True, "this machine's limits and the fastest the workload could run"),
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

    run_server(engine_config(args), args.host, args.port, args.api_key, args.served_model_name,
               args.shutdown_timeout)
    return 0


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
    llm = LLM(**dataclasses.asdict(engine_config(args)))
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
