"""Request and response bodies of POST /v1/embeddings (the conventions of protocol.py)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel

from folio.entrypoints.openai.protocol import RequestBody
from folio.entrypoints.openai.request_limits import RequestLimits


class EmbeddingRequest(RequestBody):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None  # only the model's own: a causal LM's vectors cannot be shortened
    user: Optional[str] = None
    # folio's extras (extra_body with the openai client)
    pooling_type: str = "last"  # or "mean" (folio.pooling_params)
    normalize: bool = True
    priority: int = 0
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: each input's last k tokens (-1: as many as fit)

    def check_limits(self, limits: RequestLimits) -> None:
        if isinstance(self.input, list) and self.input and not isinstance(self.input[0], int):
            limits.prompt_count(len(self.input), "input")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # a base64 string of little-endian float32 with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
