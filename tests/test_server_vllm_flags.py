"""vLLM's `serve` flags for chat that folio takes, so that a vLLM launch line runs as it is: `--chat-template` (a file
or the template itself, for every chat-shaped request), `--enable-auto-tool-choice` (folio serves "auto" unless
told not to) and `--tool-call-parser`."""

from __future__ import annotations

import pytest

from folio.cli import build_parser, server_options
from folio.entrypoints.openai.server_options import ServerOptions
from server_fixture import MODEL_NAME, running_server
from test_server_errors import assert_error

TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]


def test_a_vllm_launch_line_parses(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                      "--chat-template", str(path)])
    assert server_options(args) == ServerOptions(enable_auto_tool_choice=True, tool_call_parser="llama3_json",
                                                 chat_template=str(path))
    assert not server_options(build_parser().parse_args(["serve", "--no-enable-auto-tool-choice"])) \
        .enable_auto_tool_choice
    with pytest.raises(ValueError, match="neither a file nor a template"):
        ServerOptions(chat_template=str(tmp_path / "missing.jinja"))


def _prompt(server, messages) -> str:
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
        return http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]


@pytest.mark.parametrize("as_file", [True, False], ids=["file", "inline"])
def test_the_chat_template_renders_every_chat_request(llama_dir, tmp_path, as_file):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with running_server(llama_dir, options=ServerOptions(chat_template=str(path) if as_file else TEMPLATE)) as server:
        assert _prompt(server, MESSAGES) == "[USER] What time is it?\n[ASSISTANT] "
        with server.http() as http:
            chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                           "max_tokens": 3}).json()
            response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "What time is it?",
                                                        "max_output_tokens": 3}).json()
        assert chat["usage"]["prompt_tokens"] == response["usage"]["input_tokens"]  # the same prompt


def test_a_template_that_does_not_compile_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="chat template does not compile"):
        ServerOptions(chat_template="{% for m in messages %}")


def test_auto_tool_choice_can_be_refused(llama_dir):
    with running_server(llama_dir, options=ServerOptions(enable_auto_tool_choice=False)) as server:
        with server.http() as http:
            for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
                refused = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                                  "max_tokens": 3, **body})
                assert_error(refused, 400, '"auto" (the default beside tools) is off', "tool_choice")
            flat = [{"type": "function", **TOOLS[0]["function"]}]
            assert_error(http.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", "tools": flat}), 400,
                         "--enable-auto-tool-choice", "tool_choice")
            for choice in ("none", "required"):
                served = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                                 "max_tokens": 3, "tools": TOOLS,
                                                                 "tool_choice": choice})
                assert served.status_code == 200, served.text
