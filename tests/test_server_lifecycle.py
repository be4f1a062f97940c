"""API keys, and `folio serve` as a process: ready line, graceful shutdown on SIGTERM with exit code 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from server_fixture import MODEL_NAME, running_server

KEY = "sekret-key"


@pytest.fixture(scope="module")
def keyed_server(llama_dir):
    with running_server(llama_dir, api_key=KEY) as s:
        yield s


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                                         ("GET", "/metrics"), ("GET", "/version")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(keyed_server, method, path, headers):
    response = httpx.request(method, keyed_server.base_url + path, headers=headers, json={"prompt": "hi"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "AuthenticationError" and "key" in error["message"]


def test_api_key_accepted_and_health_open(keyed_server):
    assert httpx.get(keyed_server.base_url + "/health").status_code == 200
    client = keyed_server.openai()
    out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_no_key_configured_means_open(llama_dir):
    with running_server(llama_dir) as server:
        assert httpx.get(server.base_url + "/v1/models").status_code == 200


def test_serve_process_shuts_down_gracefully_on_sigterm(llama_dir):
    """SIGTERM mid-request: the request in flight still completes, then the process exits with code 0."""
    cmd = [sys.executable, "-m", "folio", "serve", llama_dir, "--port", "0", "--dtype", "float32",
           "--kv-cache-memory", "4MiB", "--num-threads", "1", "--served-model-name", MODEL_NAME]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        ready = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", ready)
        assert match, ready + proc.stderr.read()
        base = f"http://127.0.0.1:{match.group(1)}"
        assert httpx.get(base + "/health").status_code == 200

        first_chunk = threading.Event()
        result: dict = {}

        def stream() -> None:
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
            texts = []
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        texts.append(chunk["choices"][0]["text"])
                        result["finish"] = chunk["choices"][0]["finish_reason"]
                        first_chunk.set()
                    elif line == "data: [DONE]":
                        result["done"] = True
            result["chunks"] = len(texts)

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(20)
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        assert proc.wait(30) == 0, proc.stderr.read()
        assert result.get("done") and result["finish"] == "length" and result["chunks"] > 1
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
