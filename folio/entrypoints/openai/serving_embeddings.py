"""POST /v1/embeddings: one vector per input, pooled from the served model's final hidden states.

The model is the causal LM this server generates with, so its vectors are a convenience (similarity search
over its own representation), not those of a trained embedding model; folio.pooling_params says how they are
pooled. `encoding_format: base64` sends each vector as the base64 of its little-endian float32 bytes, which the
openai client asks for by default and decodes itself.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Union

import numpy as np
from fastapi import Request
from starlette.responses import Response

from folio.engine.async_llm import AsyncLLM, EngineError, RequestStream
from folio.engine.input_processor import check_prompt_fits, truncated
from folio.engine.output_processor import OutputKind
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol_embeddings import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                          EmbeddingUsage)
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.serving import cancel_on_disconnect, check_model
from folio.pooling_params import PoolingParams


def encode_vector(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding:
    def __init__(self, llm: AsyncLLM, model_name: str, limits: RequestLimits) -> None:
        self.llm = llm
        self.model_name = model_name
        self.limits = limits
        self.tokenizer = llm.engine.get_tokenizer()
        self.max_model_len = llm.engine.max_model_len
        self.dimensions = llm.engine.model_config.hidden_size

    async def serve(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        check_model(request.model, self.model_name)
        fields = EmbeddingRequest.model_fields
        try:
            request.check_limits(self.limits)
            inputs = await asyncio.to_thread(self._token_ids, request)
            params = PoolingParams(request.pooling_type, request.normalize, request.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        request_id = f"embd-{uuid.uuid4().hex}"
        prompts = [(f"{request_id}-{i}", {"prompt_token_ids": ids}) for i, ids in enumerate(inputs)]
        try:
            stream = await self.llm.add_requests(prompts, params, request.priority, OutputKind.FINAL_ONLY)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        return await cancel_on_disconnect(raw_request, self._collect(stream, request, inputs))

    def _token_ids(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input tokenized (in a worker thread), its size checked first; ValueError naming the field."""
        if request.dimensions is not None and request.dimensions != self.dimensions:
            raise ValueError(f"dimensions must be this model's own, {self.dimensions}: its embeddings cannot be "
                             "shortened (it was not trained for that)")
        raw = request.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        limits = self.limits.for_prompts(request.truncate_prompt_tokens)
        for item in raw:
            limits.prompt(item, "input")
        inputs = [truncated(self.tokenizer.encode(item) if isinstance(item, str) else list(item),
                            request.truncate_prompt_tokens, self.max_model_len) for item in raw]
        if not inputs or any(not ids for ids in inputs):
            raise ValueError("input must not be empty")
        check_prompt_fits(max(len(ids) for ids in inputs), self.max_model_len, "input")
        return inputs

    async def _collect(self, stream: RequestStream, request: EmbeddingRequest, inputs: list[list[int]]) -> Response:
        index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        vectors: dict[int, list[float]] = {}
        try:
            async for output in stream:
                if output.outputs is None:
                    raise EngineError("the embedding request was aborted")
                vectors[index[output.request_id]] = output.outputs.embedding
        finally:
            stream.close()
        data = [EmbeddingData(index=i, embedding=encode_vector(vectors[i], request.encoding_format))
                for i in range(len(inputs))]
        num_tokens = sum(len(ids) for ids in inputs)
        body = EmbeddingResponse(data=data, model=self.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return Response(body.model_dump_json(), media_type="application/json")
