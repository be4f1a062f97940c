"""The OpenAI-compatible HTTP server: app factory, routes, and the uvicorn runner behind `folio serve`.

How it stops: on SIGINT/SIGTERM the engine stops admitting at once (new requests get 503) and uvicorn stops
accepting connections; requests in flight get `shutdown_timeout` seconds to finish, after which the engine
ends them with finish_reason "abort", so that every stream still gets its last chunk and `[DONE]`; then the
process exits 0. An engine that dies fails its requests, and the process exits 1 (unless told to keep
running, answering 503), so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from types import FrameType
from typing import Iterator, Optional

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel
from starlette.responses import PlainTextResponse, Response

from folio import __version__
from folio.config import EngineConfig
from folio.engine.async_llm import AsyncLLM
from folio.entrypoints.openai.errors import OpenAIError, install_error_handlers
from folio.entrypoints.openai.header_timeout import header_timeout_protocol
from folio.entrypoints.openai.metrics import PrometheusStatLogger
from folio.entrypoints.openai.openapi import EVENT_STREAM, errors, install_openapi
from folio.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware, InternalErrorMiddleware,
                                                 RequestIdMiddleware)
from folio.entrypoints.openai.structured_output_metrics import StructuredOutputStatLogger
from folio.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                               CompletionResponse, DetokenizeRequest, DetokenizeResponse, ModelCard,
                                               ModelList, TokenizeRequest, TokenizeResponse)
from folio.entrypoints.openai.serving_chat import OpenAIServingChat, chat_prompt_ids
from folio.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from folio.entrypoints.openai.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.responses_store import ResponseStore
from folio.entrypoints.openai.server_options import ServerOptions, read_chat_template
from folio.entrypoints.openai.tool_call_format import TOOL_CALL_FORMATS, ToolCallFormat
from folio.entrypoints.openai.serving_completions import OpenAIServingCompletion
from folio.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding
from folio.entrypoints.openai.serving_responses import OpenAIServingResponses
from folio.loader.default_model import default_model_path
from folio.reasoning_parser import ReasoningParser
from folio.tokenizer import Tokenizer

MAX_BODY_BYTES = 16 << 20
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the embedded default model is served as


class VersionResponse(BaseModel):
    version: str


def served_model_name(model: Optional[str]) -> str:
    return model if model is not None else DEFAULT_MODEL_NAME


def served_tool_format(name: Optional[str], reasoning: Optional[ReasoningParser],
                       tokenizer: Tokenizer) -> ToolCallFormat:
    """The tool-call format the option names for this model; its default is hermes, or openai under the harmony
    reasoning parser, whose outputs only that format reads (ValueError where the option names another)."""
    harmony = reasoning is not None and reasoning.frames_grammars
    tool_format = TOOL_CALL_FORMATS[name or ("openai" if harmony else "hermes")]
    if harmony and not tool_format.whole_output:
        raise ValueError(f"reasoning_parser {reasoning.name!r} leaves the rest of a harmony output to the tool-call "
                         f"format 'openai', not {name!r}: use --tool-call-parser openai")
    return tool_format.resolve(tokenizer)


def create_app(llm: AsyncLLM, model_name: str, api_key: Optional[str] = None,
               max_body_bytes: int = MAX_BODY_BYTES, responses_store: Optional[ResponseStore] = None,
               options: ServerOptions = ServerOptions()) -> FastAPI:
    """An app serving `llm` as `model_name`. It registers its own metrics with the llm; the caller owns the llm
    (and shuts it down after the server stops). The llm's admission policy is the caller's too
    (options.admission())."""
    registry = CollectorRegistry()
    llm.stat_loggers.append(PrometheusStatLogger(model_name, registry))
    llm.stat_loggers.append(StructuredOutputStatLogger(llm.engine.structured_output.stats, model_name, registry))
    tokenizer = llm.engine.get_tokenizer()
    max_model_len = llm.engine.max_model_len
    limits = RequestLimits.build(options, tokenizer, max_model_len, llm.engine.input_processor.vocab_size)
    completions = OpenAIServingCompletion(llm, model_name, limits)
    if options.chat_template is not None:
        tokenizer.replace_chat_template(read_chat_template(options.chat_template))
    tool_format = served_tool_format(options.tool_call_parser, llm.engine.structured_output.reasoning_parser,
                                     tokenizer)
    chat = OpenAIServingChat(llm, model_name, limits, tool_format, options.enable_auto_tool_choice)
    embeddings = OpenAIServingEmbedding(llm, model_name, limits)
    responses = OpenAIServingResponses(llm, model_name, limits, responses_store or ResponseStore(), tool_format,
                                       options.enable_auto_tool_choice)

    app = FastAPI(title="folio", version=__version__)
    install_error_handlers(app)
    install_openapi(app, api_key=bool(api_key))
    app.state.rejections = Counter("folio:requests_rejected", "Requests refused with 503 because the waiting "
                                   "queue was at its bound (backpressure).", ["model_name"],
                                   registry=registry).labels(model_name)

    @app.get("/health", response_class=Response, responses={200: {"description": "the engine takes requests"}})
    async def health() -> Response:
        if not llm.is_accepting:
            raise OpenAIError(503, "the engine is shutting down" if llm.dead is None else
                              f"the engine is not running: {llm.dead!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    card = ModelCard(id=model_name, root=llm.engine.config.model.model or default_model_path(),
                     max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", responses=errors(404))
    async def model(model_id: str) -> ModelCard:
        chat.check_model(model_id)
        return card

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**EVENT_STREAM, **errors(400, 404, 413, 504)})
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.serve(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**EVENT_STREAM, **errors(400, 404, 413, 504)})
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.serve(request, raw_request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors(400, 404, 413, 504))
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.serve(request, raw_request)

    @app.post("/v1/responses", response_model=ResponseObject,
              responses={**EVENT_STREAM, **errors(400, 404, 413, 504)})
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}", responses=errors(400, 404))
    async def retrieve_response(response_id: str, raw_request: Request) -> ResponseObject:
        return responses.retrieve(response_id, dict(raw_request.query_params))

    @app.delete("/v1/responses/{response_id}", responses=errors(404))
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    def tokenize_ids(request: TokenizeRequest) -> list[int]:
        if request.prompt is not None:
            limits.text(request.prompt)
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        limits.tools(request.tools)
        return chat_prompt_ids(tokenizer, limits, request.messages, request.add_generation_prompt, request.tools,
                               continue_final_message=request.continue_final_message)

    @app.post("/tokenize", responses=errors(400, 404, 413))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        try:
            tokens = await asyncio.to_thread(tokenize_ids, request)
        except ValueError as e:
            raise OpenAIError.bad_request(e, TokenizeRequest.model_fields) from e
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)

    @app.post("/detokenize", responses=errors(400, 404, 413))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens holds ids outside the vocabulary [0, {tokenizer.vocab_size}): {bad[:5]}",
                              "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, request.tokens))

    app.add_middleware(InternalErrorMiddleware)  # innermost of these: a 500 it makes passes through the rest
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # outside the body limit: no body read without a key
    app.add_middleware(RequestIdMiddleware)  # outermost: a 401 carries the id too
    return app


# What uvicorn waits for past the engine's shutdown deadline: the last chunks and [DONE] of the streams it aborted.
_STREAM_END_GRACE_SECONDS = 5.0


class FolioServer(uvicorn.Server):
    """uvicorn's server, stopping as `folio serve` promises (see the module docstring).

    uvicorn re-raises the signal that stopped it once it has shut down, so the process would die of SIGTERM
    (exit 143); a graceful stop is a success, so the signals are taken without re-raising them."""

    def __init__(self, llm: AsyncLLM, app: FastAPI, options: ServerOptions) -> None:
        super().__init__(uvicorn.Config(
            app, log_level="warning", access_log=False, limit_concurrency=options.max_connections,
            http=header_timeout_protocol(options.header_timeout),
            timeout_graceful_shutdown=options.shutdown_timeout + _STREAM_END_GRACE_SECONDS))
        self.llm = llm
        self.options = options
        self.engine_died = False

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        self.llm.begin_shutdown(self.options.shutdown_timeout)  # stop admitting now, not when uvicorn gets to it
        super().handle_exit(sig, frame)

    def serve_until_stopped(self, sock: socket.socket) -> int:
        """Serve on a bound socket until a signal or the engine's death, then shut the engine down; the process's
        exit status."""
        try:
            self.run(sockets=[sock])
        finally:
            self.llm.shutdown()
            sock.close()
        return 1 if self.engine_died else 0

    async def on_tick(self, counter: int) -> bool:
        if self.llm.dead is not None and self.options.exit_on_engine_death:
            self.engine_died = True
            return True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before the model loads (as vLLM does): the port is ours, and a taken one fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
               model_name: Optional[str] = None, options: ServerOptions = ServerOptions()) -> int:
    """`folio serve`: load the model, serve until SIGINT/SIGTERM or the engine's death; the exit status."""
    sock = bind_socket(host, port)
    llm = AsyncLLM.from_config(config, admission=options.admission())
    name = model_name or served_model_name(config.model.model)
    app = create_app(llm, name, api_key, options=options)
    shown_host = f"[{host}]" if ":" in host else host
    print(f"folio: serving {name} at http://{shown_host}:{sock.getsockname()[1]}/v1 (pid {os.getpid()})",
          flush=True)
    return FolioServer(llm, app, options).serve_until_stopped(sock)
