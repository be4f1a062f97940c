"""The `folio` command: help, engine flags for every EngineConfig field, generate and chat on the tiny model."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest

from folio import LLM, SamplingParams
from folio.cli import build_parser, engine_config, main, server_options
from folio.config import EngineConfig, engine_options
from folio.entrypoints.openai.server_options import ServerOptions
from folio.spec_decode.config import SpeculativeConfig

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--num-threads", "1"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _keep_log_level(monkeypatch):
    """main() quiets folio's logger for generate and chat unless the level is set: keep this process's level."""
    monkeypatch.setenv("FOLIO_LOGGING_LEVEL", "INFO")


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: folio {' '.join(command)}".rstrip())
    if command:
        assert "--max-num-batched-tokens" in text and "--kv-cache-memory" in text
    if command == ["serve"]:
        assert all(flag in text for flag in ("--host", "--port", "--api-key", "--served-model-name"))
    if command in (["generate"], ["chat"]):
        assert all(flag in text for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed"))


def test_server_options_are_serve_flags():
    """Each ServerOptions field is a `folio serve` flag; flags left out keep the definition's default."""
    assert server_options(build_parser().parse_args(["serve"])) == ServerOptions()
    args = build_parser().parse_args(["serve", "--max-stop-strings", "5", "--request-timeout", "2.5",
                                      "--no-exit-on-engine-death", "--max-waiting-requests", "0"])
    assert server_options(args) == ServerOptions(max_stop_strings=5, request_timeout=2.5, exit_on_engine_death=False,
                                                 max_waiting_requests=0)
    assert server_options(args).admission().max_waiting_requests is None  # 0: no bound
    with pytest.raises(ValueError, match="request_timeout"):
        ServerOptions(request_timeout=0)


ENGINE_COMMANDS = [["serve"], ["generate"], ["chat"], ["bench", "throughput"], ["bench", "baseline"],
                   ["bench", "roofline"], ["bench", "perplexity"]]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_option_is_a_flag(command):
    values = {"model": "/some/model", "dtype": "bfloat16", "block_size": 8, "kv_cache_memory": 1 << 20,
              "max_num_seqs": 3, "max_num_batched_tokens": 64, "max_model_len": 100, "scheduling_policy": "priority",
              "enable_prefix_caching": False, "seed": 5, "num_threads": 2, "attention_backend": "torch_sdpa",
              "quantization": "int4", "kv_cache_dtype": "int8",
              "speculative_config": SpeculativeConfig("ngram", num_speculative_tokens=3),
              "structured_outputs_backend": "llguidance", "reasoning_parser": "deepseek_r1",
              "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert set(values) == {option.name for _, option, _ in engine_options()}, "a new engine option needs a flag"
    argv = list(command)
    for name, value in values.items():
        flag = f"--{name.replace('_', '-')}"
        text = json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value) else str(value)
        argv += ([flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, text])
    config = engine_config(build_parser().parse_args(argv))
    assert {option.name: getattr(getattr(config, group), option.name)
            for group, option, _ in engine_options()} == values  # each flag lands in its option's group
    defaults = build_parser().parse_args(command)
    assert engine_config(defaults) == EngineConfig()  # flags left out leave EngineConfig's defaults alone


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_engine_flag_help_is_the_definition(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag, so that the text reads as written
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    for _, option, _ in engine_options():
        assert f"--{option.name.replace('_', '-')}" in text
        assert f"{option.metadata['help']} (default: {option.metadata['default_means'] or ''}" in text


@pytest.mark.parametrize("text,value", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("512M", 512 << 20),
                                        ("1000000", 1000000), ("0.3", 0.3), ("1.5GB", 3 << 29)])
def test_kv_cache_memory_flag(text, value):
    assert build_parser().parse_args(["generate", "--kv-cache-memory", text]).kv_cache_memory == value


def test_serve_model_given_twice_is_an_error():
    with pytest.raises(SystemExit, match="once"):
        main(["serve", "a", "--model", "b"])


def _greedy(llama_dir: str, prompts: list, max_tokens: int) -> list[str]:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=4 << 20, num_threads=1)
    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                                                    use_tqdm=False)]


def test_generate_process_prints_completions(llama_dir):
    prompts = ["Once upon a time", "hello"]
    out = subprocess.run([sys.executable, "-m", "folio", "generate", "--model", llama_dir, *ENGINE_FLAGS,
                          "--max-tokens", "6", "--temperature", "0", *prompts],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = _greedy(llama_dir, prompts, 6)
    assert out.stdout == "".join(f"==> {p} <==\n{text}\n" for p, text in zip(prompts, expected))


def test_generate_reads_stdin_and_files(llama_dir, tmp_path, monkeypatch, capsys):
    expected = _greedy(llama_dir, ["first prompt", "second prompt"], 4)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first prompt\n\nsecond prompt\n"))
    assert main(["generate", "--model", llama_dir, *ENGINE_FLAGS, "--max-tokens", "4", "--temperature", "0"]) == 0
    from_stdin = capsys.readouterr().out
    assert from_stdin == f"==> first prompt <==\n{expected[0]}\n==> second prompt <==\n{expected[1]}\n"
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\nsecond prompt\n")
    assert main(["generate", "--model", llama_dir, *ENGINE_FLAGS, "--max-tokens", "4", "--temperature", "0",
                 "--file", str(path)]) == 0
    assert capsys.readouterr().out == from_stdin


def test_bad_engine_option_is_a_clean_error(llama_dir, capsys):
    assert main(["generate", "--model", llama_dir, "--block-size", "0", "hi"]) == 1
    assert "block_size" in capsys.readouterr().err


def test_chat_process_keeps_the_conversation(llama_dir):
    """Two turns through stdin, then EOF; the second reply is the one for the whole conversation so far."""
    folio = os.path.join(os.path.dirname(sys.executable), "folio")  # the console script
    out = subprocess.run([folio, "chat", llama_dir, *ENGINE_FLAGS, "--max-tokens", "8", "--temperature", "0",
                          "--system", "be brief"], input="hello there\nand again\n", capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=4 << 20, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    first = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "and again"}]
    second = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    assert out.stdout == f"> {first}\n> {second}\n> \n"


def test_chat_exit_command(llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\nnever read\n"))
    assert main(["chat", "--model", llama_dir, *ENGINE_FLAGS]) == 0
    assert capsys.readouterr().out == "> "
