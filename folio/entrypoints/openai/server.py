"""The OpenAI-compatible HTTP server: app factory, routes, and the uvicorn runner behind `folio serve`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Iterator, Optional

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from folio import __version__
from folio.config import EngineConfig
from folio.engine.async_llm import AsyncLLM
from folio.entrypoints.openai.errors import OpenAIError, install_error_handlers
from folio.entrypoints.openai.metrics import PrometheusStatLogger
from folio.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from folio.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                               TokenizeResponse)
from folio.entrypoints.openai.serving_chat import OpenAIServingChat, chat_prompt_ids
from folio.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from folio.entrypoints.openai.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from folio.entrypoints.openai.responses_store import ResponseStore
from folio.entrypoints.openai.serving_completions import OpenAIServingCompletion
from folio.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding
from folio.entrypoints.openai.serving_responses import OpenAIServingResponses
from folio.loader.default_model import default_model_path

MAX_BODY_BYTES = 16 << 20
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the embedded default model is served as


def served_model_name(model: Optional[str]) -> str:
    return model if model is not None else DEFAULT_MODEL_NAME


def create_app(llm: AsyncLLM, model_name: str, api_key: Optional[str] = None,
               max_body_bytes: int = MAX_BODY_BYTES, responses_store: Optional[ResponseStore] = None) -> FastAPI:
    """An app serving `llm` as `model_name`. It registers its own metrics with the llm; the caller owns the llm
    (and shuts it down after the server stops)."""
    registry = CollectorRegistry()
    llm.stat_loggers.append(PrometheusStatLogger(model_name, registry))
    completions = OpenAIServingCompletion(llm, model_name)
    chat = OpenAIServingChat(llm, model_name)
    embeddings = OpenAIServingEmbedding(llm, model_name)
    responses = OpenAIServingResponses(llm, model_name, responses_store or ResponseStore())
    tokenizer = llm.engine.get_tokenizer()
    max_model_len = llm.engine.max_model_len

    app = FastAPI(title="folio", version=__version__)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_healthy:
            raise OpenAIError(503, f"the engine is not running: {llm.dead!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    card = ModelCard(id=model_name, root=llm.engine.config.model.model or default_model_path(),
                     max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        chat.check_model(model_id)
        return card

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.serve(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.serve(request, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.serve(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request) -> ResponseObject:
        return responses.retrieve(response_id, dict(raw_request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        try:
            if request.prompt is not None:
                tokens = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            else:
                tokens = chat_prompt_ids(tokenizer, request.messages, request.add_generation_prompt, request.tools)
        except ValueError as e:
            raise OpenAIError.bad_request(e, TokenizeRequest.model_fields) from e
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens holds ids outside the vocabulary [0, {tokenizer.vocab_size}): {bad[:5]}",
                              "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # outside the body limit: no body read without a key
    app.add_middleware(RequestIdMiddleware)  # outermost: a 401 carries the id too
    return app


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises the signal that stopped it once it has shut down, so the process would die of SIGTERM
    (exit 143); a graceful stop is a success, so take the signals without re-raising them."""

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
               model_name: Optional[str] = None, shutdown_timeout: float = 30.0) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, give requests in flight `shutdown_timeout` seconds to
    finish, abort the rest, and return."""
    sock = bind_socket(host, port)
    llm = AsyncLLM.from_config(config)
    name = model_name or served_model_name(config.model.model)
    app = create_app(llm, name, api_key)
    server = _GracefulServer(uvicorn.Config(app, log_level="warning", access_log=False,
                                            timeout_graceful_shutdown=shutdown_timeout))
    shown_host = f"[{host}]" if ":" in host else host
    print(f"folio: serving {name} at http://{shown_host}:{sock.getsockname()[1]}/v1 (pid {os.getpid()})",
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        llm.shutdown()
        sock.close()
