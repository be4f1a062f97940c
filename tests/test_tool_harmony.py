"""GPT-OSS's harmony format (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`): the reasoning
splitter and the call reader fed every split of sample outputs, the grammars on a tokenizer with harmony's special
tokens, and through the server on a copy of the tiny random model with them: chat (streamed and not) and the
Responses API give the analysis as reasoning, and the calls the grammars force as tool calls, with no marker in
the content."""

from __future__ import annotations

import json

import openai
import pytest

from folio.entrypoints.openai.protocol import ChatTool, NamedFunction, NamedToolChoice
from folio.entrypoints.openai.protocol_responses import ResponsesRequest
from folio.entrypoints.openai.responses_turn import Turn
from folio.entrypoints.openai.server_options import ServerOptions
from folio.entrypoints.openai.tool_harmony import HarmonyToolCallReader, harmony_constraint
from folio.harmony import MARKERS
from folio.harmony_split import HarmonyTokens
from folio.outputs import CompletionOutput, RequestOutput
from folio.reasoning_parser import REASONING_PARSERS
from folio.reasoning_split import ReasoningSplit
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer
from reasoning_fixture import build_reasoning_model
from server_fixture import MODEL_NAME, running_server
from tool_format_fixture import EOS, accepts, assert_valid, llguidance_backend, read_pieces

NAMES = ["get_time", "get_weather"]
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}'
THINK = "<|channel|>analysis<|message|>User asks time.<|end|>"
CUT = THINK + CALL[:-6]  # max_tokens ran out inside the call's arguments: the call has no end

# (output text, reasoning, content, calls): the end-of-sequence marker (<|return|>, <|call|>) is not in the text
CASES = [
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is noon.", "User asks time.", "It is noon.", []),
    (THINK + CALL, "User asks time.", "", [("get_time", '{"tz": "UTC"}')]),
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL, "User asks time.",
     "Checking.", [("get_time", '{"tz": "UTC"}')]),  # a preamble is content
    (CALL + "<|call|>" + CALL.replace("get_time", "get_weather").replace('"tz": "UTC"', '"city": "Oslo"'), "", "",
     [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]),  # two calls
    ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}', "", "",
     [("get_time", "{}")]),  # the recipient before the channel
    ("<|channel|>analysis<|message|>Hmm, the us", "Hmm, the us", "", []),  # cut off in the reasoning
    (CUT, "User asks time.", "", [("get_time", '{"tz": ')]),  # cut off in the call: as it came
    (THINK + "<|start|>assistant<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}",
     "User asks time.", "{}", []),  # a function not among the tools: content
    (THINK + "<|start|>assistant<|channel|>commentary to=browser.search<|message|>{}", "User asks time.", "{}",
     []),  # not a function
    ("<|channel|>final<|message|>Hi <|start|", "", "Hi <|start|", []),  # a marker's start, then the end
    ("<|channel|>final<|message|>a <| b", "", "a <| b", []),  # not a marker
    ("no harmony at all", "", "no harmony at all", []),
]


class _Tokenizer:
    """What the splitter needs of a tokenizer, for text-only cases: the markers' ids and decoding."""

    def __init__(self) -> None:
        self.backend = self
        self.all_special_ids = {self.token_to_id(marker) for marker in MARKERS}

    def token_to_id(self, marker: str) -> int:
        return 1000 + MARKERS.index(marker)

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(MARKERS[i - 1000] for i in ids)


def split_and_read(pieces: list[str], names=NAMES, cut: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    tokenizer = _Tokenizer()
    splitter = REASONING_PARSERS["openai_gptoss"].splitter(tokenizer, [])
    reader = HarmonyToolCallReader(names)
    reasoning, rest = "", []
    for i, piece in enumerate(pieces):
        split = splitter.feed(piece, (), final=i == len(pieces) - 1)
        reasoning += split.reasoning
        rest.append(split.content)
    content, calls, _ = read_pieces(reader, rest, cut)
    for text in (reasoning, content):
        assert not any(marker in text for marker in MARKERS)
    return reasoning, content, [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_every_split_reads_as_the_whole(text, reasoning, content, calls):
    cut = text == CUT
    assert split_and_read([text], cut=cut) == (reasoning, content, calls)
    assert split_and_read(list(text), cut=cut) == (reasoning, content, calls)
    for i in range(len(text)):
        assert split_and_read([text[:i], text[i:]], cut=cut) == (reasoning, content, calls), i


def test_a_call_cut_off_by_max_tokens_is_incomplete_in_the_responses_api():
    """As a Hermes call cut off: the call that ended with `<|call|>` (left out of the text) is complete, the one the
    tokens ran out in is not, and neither is the response."""
    tools = [{"type": "function", "name": name} for name in NAMES]
    request = ResponsesRequest.model_validate({"input": "hi", "tools": tools})
    for text, finish, status in ((CALL, "stop", "completed"), (CALL[:-6], "length", "incomplete")):
        turn = Turn(request, SamplingParams(), "m", [], 3, HarmonyToolCallReader(NAMES))
        turn.add(RequestOutput("r", None, [1], [CompletionOutput(0, text, [5], finish_reason=finish)], True))
        turn.finish()
        response = turn.response()
        assert [(item.type, item.status) for item in response.output] == [("function_call", status)]
        assert response.status == status


def test_without_a_reasoning_parser_the_analysis_is_content_and_none_calls_nothing():
    content, calls, _ = read_pieces(HarmonyToolCallReader(NAMES), [THINK + CALL])
    assert (content, len(calls)) == ("User asks time.", 1)
    content, calls, _ = read_pieces(HarmonyToolCallReader([]), [THINK + CALL])  # tool_choice "none"
    assert (content, calls) == ('User asks time.{"tz": "UTC"}', [])
    # after a prefill (the splitter hands on its message's header where there is one): text in no message
    content, calls, _ = read_pieces(HarmonyToolCallReader(NAMES), ["ing.<|end|>" + CALL])
    assert (content, len(calls)) == ("ing.", 1)


HARMONY_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' %}{% if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>
{{- message.thinking }}<|end|>{% endif %}{% for call in message.tool_calls or [] %}<|start|>assistant to=functions.
{{- call.function.name }}<|channel|>commentary json<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor %}{% if message.content %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- elif message.role == 'tool' %}<|start|>functions.x to=assistant<|channel|>commentary<|message|>
{{- message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_reasoning_model(str(tmp_path_factory.mktemp("harmony")), MARKERS, True, HARMONY_TEMPLATE)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
            "additionalProperties": False}


def test_the_grammars_take_what_the_reader_reads(folder):
    backend = llguidance_backend(folder)
    tokens = HarmonyTokens.of(backend[0])
    tools = [ChatTool.model_validate(tool) for tool in TOOLS]

    def constraint(tool_choice, schema=None):
        return harmony_constraint(tools, tool_choice, True, schema, tokens=tokens)

    final = "<|channel|>final<|message|>It is noon."
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    call = CALL.removeprefix("<|start|>assistant")
    for text in (final, call, THINK + "<|start|>assistant" + call, preamble + call, THINK + "<|start|>assistant" + final):
        assert accepts(backend, constraint("auto"), text), text
    for text in (call.replace("UTC", "PST"), "It is noon.", final + "<|end|>", THINK):
        assert not accepts(backend, constraint("auto"), text), text
    required = constraint("required")
    assert accepts(backend, required, THINK + "<|start|>assistant" + call) and not accepts(backend, required, final)
    assert not accepts(backend, required, preamble + call)
    named = constraint(NamedToolChoice(type="function", function=NamedFunction(name="get_weather")))
    assert not accepts(backend, named, call)
    assert accepts(backend, named, call.replace("get_time", "get_weather").replace('"tz": "UTC"', '"city": "Oslo"'))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer = '<|channel|>final<|message|>{"n": 1}'
    assert constraint("none") is None
    assert accepts(backend, constraint("none", schema), THINK + "<|start|>assistant" + answer)
    assert not accepts(backend, constraint("none", schema), final) and not accepts(backend, constraint("none", schema), call)
    assert accepts(backend, constraint("auto", schema), answer) and accepts(backend, constraint("auto", schema), call)
    # the markers must be the special tokens: the same characters as plain text are refused
    as_text = [t for piece in call.split("<|message|>") for t in backend[0].encode(piece.replace("<|", "< |"), False)]
    assert not backend[1].compile(required).accept_tokens(as_text + [EOS])


PROMPT = "<|start|>user<|message|>Time?<|end|><|start|>assistant"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

# (the prompt's end, the output, its reasoning, its content, its calls): an assistant prefill (continue_final_message)
# ends inside its message, which the output goes on
PREFILLS = [
    ("", THINK + FINAL + "It is noon.", "User asks time.", "It is noon.", []),  # no prefill
    ("<|channel|>final<|message|>It is", " noon.", "", " noon.", []),
    ("<|channel|>analysis<|message|>User asks", " time.<|end|>" + FINAL + "Noon.", " time.", "Noon.", []),
    ("<|channel|>analysis<|message|>User asks", " time.<|end|>" + CALL, " time.", "", [("get_time", '{"tz": "UTC"}')]),
    ("<|channel|>commentary<|message|>Check", "ing.<|end|>" + CALL, "", "ing.", [("get_time", '{"tz": "UTC"}')]),
]


def split_by_token(folder: str, prefill: str, output: str) -> tuple[Tokenizer, list[int], list[ReasoningSplit]]:
    """The output's tokens, fed one at a time as a stream gives them to the splitter of a prompt that ends with
    `prefill`, and what each gave."""
    tokenizer = Tokenizer.from_dir(folder)
    prompt = tokenizer.encode(PROMPT + prefill, add_special_tokens=False)
    splitter = REASONING_PARSERS["openai_gptoss"].splitter(tokenizer, prompt)
    ids = tokenizer.encode(output, add_special_tokens=False)
    return tokenizer, ids, [splitter.feed(tokenizer.decode([token], skip_special_tokens=False), [token],
                                          final=i == len(ids) - 1) for i, token in enumerate(ids)]


@pytest.mark.parametrize("prefill, output, reasoning, content, calls", PREFILLS)
def test_the_output_goes_on_where_the_prompt_leaves_off(folder, prefill, output, reasoning, content, calls):
    """The reasoning, content and calls, and the reasoning tokens (an analysis message's from its <|message|> to
    its end marker)."""
    tokenizer, _, splits = split_by_token(folder, prefill, output)
    read, read_calls, _ = read_pieces(HarmonyToolCallReader(NAMES), [split.content for split in splits])
    assert ("".join(split.reasoning for split in splits), read,
            [(c.function.name, c.function.arguments) for c in read_calls]) == (reasoning, content, calls)
    analysis = output[:output.index("<|end|>") + len("<|end|>")] if reasoning else ""
    assert sum(split.num_reasoning_tokens for split in splits) == \
        len(tokenizer.encode(analysis.removeprefix("<|channel|>analysis"), add_special_tokens=False))


@pytest.mark.parametrize("prefill, output, reasoning, content, calls", PREFILLS)
def test_the_content_s_tokens_are_its_text_s(folder, prefill, output, reasoning, content, calls):
    """Not the headers', the markers', the reasoning's or the calls' (the logprobs chat gives are theirs)."""
    tokenizer, ids, splits = split_by_token(folder, prefill, output)
    kept = [token for token, split in zip(ids, splits) for _ in split.content_tokens]
    assert tokenizer.decode(kept, skip_special_tokens=False) == content


@pytest.fixture(scope="module")
def client(folder):
    with running_server(folder, options=ServerOptions(), reasoning_parser="openai_gptoss") as server:
        yield server.openai()


def _sampling(folder: str, seed: int) -> dict:
    """A bias towards harmony's markers where the grammar offers them (the random model would think forever)."""
    tokenizer = Tokenizer.from_dir(folder)
    bias = {str(tokenizer.backend.token_to_id(m)): 8 for m in ("<|end|>", "<|message|>")}
    return dict(model=MODEL_NAME, temperature=1.0, max_tokens=120, extra_body={"seed": seed, "logit_bias": bias})


def test_reasoning_and_a_forced_call_through_chat_streamed_and_not(client, folder):
    messages = [{"role": "user", "content": "Weather?"}]
    for seed in range(3):
        kwargs = dict(messages=messages, tools=TOOLS, tool_choice="required", **_sampling(folder, seed))
        choice = client.chat.completions.create(**kwargs).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid(call, TOOLS)
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        assert reasoning is None or not any(m in reasoning for m in MARKERS)
        streamed_reasoning, arguments, names = "", "", []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            assert not delta.content
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for piece in delta.tool_calls or ():
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
        assert (streamed_reasoning or None, names, arguments) == (reasoning, [call.function.name],
                                                                  call.function.arguments)
        # the call and its reasoning go back to the template
        back = messages + [{"role": "assistant", "content": None, "reasoning_content": reasoning or "x",
                            "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        assert client.chat.completions.create(messages=back, **_sampling(folder, seed)).choices[0].message


def test_a_json_answer_after_reasoning_and_structured_outputs_refused(client, folder):
    reply = client.chat.completions.create(messages=[{"role": "user", "content": "n?"}], **_sampling(folder, 1),
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "n", "schema": N_SCHEMA}})
    assert json.loads(reply.choices[0].message.content)["n"] in range(10)
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "n?"}],
                                       extra_body={"structured_outputs": {"choice": ["a", "b"]}})


def test_responses_give_reasoning_and_a_call_item(client, folder):
    sampling = _sampling(folder, 2)
    response = client.responses.create(model=MODEL_NAME, input="Weather?", tool_choice="required",
                                       tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
                                       max_output_tokens=120, temperature=1.0, extra_body=sampling["extra_body"])
    kinds = [item.type for item in response.output]
    assert kinds in (["function_call"], ["reasoning", "function_call"]) and response.status == "completed"
    assert_valid(response.output[-1], TOOLS)


def test_logprobs_are_the_content_s_tokens_streamed_and_not(client, folder):
    """Not the headers' and markers', nor the reasoning's (with include_reasoning or not)."""
    sampling = _sampling(folder, 1)
    for include_reasoning in (True, False):
        kwargs = dict(sampling, messages=[{"role": "user", "content": "n?"}], logprobs=True,
                      response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": N_SCHEMA}},
                      extra_body={**sampling["extra_body"], "include_reasoning": include_reasoning})
        choice = client.chat.completions.create(**kwargs).choices[0]
        tokens = [lp.token for lp in choice.logprobs.content]
        assert choice.message.content and "".join(tokens) == choice.message.content
        streamed, streamed_tokens = "", []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            streamed += chunk.choices[0].delta.content or ""
            logprobs = chunk.choices[0].logprobs
            streamed_tokens += [lp.token for lp in logprobs.content] if logprobs else []
        assert (streamed, streamed_tokens) == (choice.message.content, tokens)


def test_a_responses_message_s_logprobs_are_its_text_s(client, folder):
    response = client.responses.create(model=MODEL_NAME, input="n?", max_output_tokens=120, temperature=1.0,
                                       include=["message.output_text.logprobs"],
                                       text={"format": {"type": "json_schema", "name": "n", "schema": N_SCHEMA}},
                                       extra_body=_sampling(folder, 1)["extra_body"])
    (text,) = response.output[-1].content
    assert text.text and "".join(lp.token for lp in text.logprobs) == text.text


def test_a_prefill_goes_on_as_content(client, folder):
    """The continuation of a final message is content, its tokens the logprobs' (the prompt leaves the reader in
    the message's body: no header to read)."""
    x = Tokenizer.from_dir(folder).encode("x", add_special_tokens=False)[0]
    kwargs = dict(model=MODEL_NAME, max_tokens=4, logprobs=True,
                  messages=[{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "It is"}],
                  extra_body={"continue_final_message": True, "add_generation_prompt": False,
                              "logit_bias": {str(x): 100}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == "xxxx" == "".join(lp.token for lp in choice.logprobs.content)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(stream=True, **kwargs)) == "xxxx"


def test_responses_give_a_call_cut_off_by_max_output_tokens_as_incomplete(client, folder):
    sampling = _sampling(folder, 2)
    kwargs = dict(model=MODEL_NAME, input="Weather?", tool_choice="required", temperature=1.0,
                  tools=[{"type": "function", **tool["function"]} for tool in TOOLS], extra_body=sampling["extra_body"])
    whole = client.responses.create(max_output_tokens=120, **kwargs)
    assert whole.status == "completed" and whole.output[-1].status == "completed"
    # the same tokens, but for the end of sequence and the arguments' last token
    cut = client.responses.create(max_output_tokens=whole.usage.output_tokens - 2, **kwargs)
    call = cut.output[-1]
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (call.type, call.status) == ("function_call", "incomplete")
    assert whole.output[-1].arguments.startswith(call.arguments) and call.arguments != whole.output[-1].arguments
    events = list(client.responses.create(stream=True, max_output_tokens=whole.usage.output_tokens - 2, **kwargs))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[-1].status == "incomplete"
    (done,) = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert (done.item.status, done.item.arguments) == ("incomplete", call.arguments)


def test_the_harmony_reasoning_parser_needs_the_openai_format(folder):
    with pytest.raises(ValueError, match="tool-call-parser openai"):
        with running_server(folder, options=ServerOptions(tool_call_parser="hermes"), reasoning_parser="openai_gptoss"):
            pass
