"""LangChain's OpenAI integration against the server: ChatOpenAI over the Responses API and over chat
completions (plain and streamed), and OpenAIEmbeddings."""

from __future__ import annotations

import pytest

from server_fixture import MODEL_NAME

langchain_openai = pytest.importorskip("langchain_openai")


@pytest.mark.parametrize("use_responses_api", [True, False])
def test_chat_openai_answers(llama_server, use_responses_api):
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=f"{llama_server.base_url}/v1", api_key="none",
                                      use_responses_api=use_responses_api, max_tokens=5, temperature=0, max_retries=0)
    answer = llm.invoke("hello")
    assert answer.text and answer.response_metadata["model_name"] == MODEL_NAME
    assert "".join(chunk.text for chunk in llm.stream("hello")) == answer.text


def test_openai_embeddings(llama_server):
    embeddings = langchain_openai.OpenAIEmbeddings(model=MODEL_NAME, base_url=f"{llama_server.base_url}/v1",
                                                   api_key="none", check_embedding_ctx_length=False, max_retries=0)
    query = embeddings.embed_query("hello")
    assert len(query) == 64 and abs(sum(v * v for v in query) - 1) < 1e-4
    assert embeddings.embed_documents(["hello", "world"])[0] == pytest.approx(query, abs=1e-6)
    llama_server.wait_idle()
