"""`folio bench`: each benchmark runs on the tiny model for a few requests and reports the fields it promises.

No timing is asserted (the machine is shared); only that the reports are complete and add up.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from folio import LLM, SamplingParams
from folio.bench.make_model import ARCHITECTURES, weight_shapes
from folio.bench.report import summarize
from folio.bench.step_profile import PHASES
from folio.cli import main
from folio.memory import peak_resident_bytes
from server_fixture import MODEL_NAME, running_server

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--num-threads", "1"]
SUMMARY_FIELDS = {"count", "mean", "p50", "p90", "p99", "min", "max"}


@pytest.fixture(autouse=True)
def _keep_log_level(monkeypatch):
    """main() quiets folio's logger for commands other than serve unless the level is set: keep this process's."""
    monkeypatch.setenv("FOLIO_LOGGING_LEVEL", "INFO")


def _run(argv: list[str], path: str) -> dict:
    assert main(argv) == 0
    with open(path) as f:
        return json.load(f)


def test_summary_percentiles():
    s = summarize([float(i) for i in range(1, 101)])
    assert (s.count, s.mean, s.p50, s.min, s.max) == (100, 50.5, 50.5, 1.0, 100.0)
    assert s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert summarize([]) is None


def test_throughput_reports_rates_and_a_breakdown_that_adds_up(llama_dir, tmp_path, capsys):
    out = str(tmp_path / "tp.json")
    report = _run(["bench", "throughput", "--model", llama_dir, *ENGINE_FLAGS, "--num-prompts", "6", "--input-len",
                   "20", "--output-len", "5", "--max-num-seqs", "4", "--json", out], out)
    assert (report["num_requests"], report["prompt_tokens"], report["output_tokens"]) == (6, 120, 30)
    assert report["output_tokens_per_s"] == pytest.approx(30 / report["elapsed_s"])
    assert report["total_tokens_per_s"] == pytest.approx(150 / report["elapsed_s"])
    assert report["requests_per_s"] == pytest.approx(6 / report["elapsed_s"])
    assert set(report["ttft"]) == SUMMARY_FIELDS and report["ttft"]["count"] == 6
    assert report["other_cores"] >= 0
    # the peak of this process when the run ended: positive, and not above its peak now
    assert 0 < report["peak_rss_bytes"] <= peak_resident_bytes()
    b = report["breakdown"]
    assert set(b["phases"]) == set(PHASES)
    assert all(p["total_s"] >= 0 for name, p in b["phases"].items() if name != "other")
    assert sum(p["total_s"] for p in b["phases"].values()) == pytest.approx(b["step_total_s"])
    assert sum(p["percent"] for p in b["phases"].values()) == pytest.approx(100.0)
    for name in ("scheduling", "model forward", "attention", "lm_head", "output processing"):
        assert b["phases"][name]["total_s"] > 0, name  # every wrapped phase was seen
    assert b["phases"]["sampling"]["total_s"] == 0  # greedy steps take their tokens with the lm_head's argmax
    assert b["model_forward_with_attention_ms"] >= b["phases"]["attention"]["per_step_ms"]
    # 6 requests at most 4 at a time: 2 waves, each a prefill step and 4 decode-only steps (3 steps for the 2nd
    # wave may overlap the 1st's last decode), so at least 8 decode-only steps and 2 with prefill
    assert b["decode"]["num_steps"] >= 6 and b["prefill"]["num_steps"] >= 2
    assert b["decode"]["num_steps"] + b["prefill"]["num_steps"] == b["num_steps"]
    assert b["decode"]["mean_tokens"] == b["decode"]["mean_requests"] <= 4
    for kind in (b["decode"], b["prefill"]):  # each kind's own phase table adds up to its mean step
        assert set(kind["phase_ms"]) == set(PHASES)
        assert sum(kind["phase_ms"].values()) == pytest.approx(kind["mean_ms"])
    text = capsys.readouterr().out
    assert "output tokens/s" in text and "step breakdown" in text and "attention" in text
    assert "peak resident memory" in text


def test_throughput_with_random_sampling(llama_dir, tmp_path):
    out = str(tmp_path / "tp.json")
    report = _run(["bench", "throughput", "--model", llama_dir, *ENGINE_FLAGS, "--num-prompts", "4", "--input-len",
                   "12", "--output-len", "6", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
                   "--warmup-prompts", "0", "--no-breakdown", "--json", out], out)
    assert report["output_tokens"] == 24  # EOS ignored under sampling too
    assert "temperature 0.8, top_p 0.9, top_k 20" in report["workload"]
    default = _run(["bench", "throughput", "--model", llama_dir, *ENGINE_FLAGS, "--num-prompts", "2", "--input-len",
                    "8", "--output-len", "2", "--warmup-prompts", "0", "--no-breakdown", "--json", out], out)
    assert default["workload"].endswith("greedy")


def test_throughput_chat_dataset_without_breakdown(llama_dir, tmp_path):
    out = str(tmp_path / "tp.json")
    report = _run(["bench", "throughput", "--model", llama_dir, *ENGINE_FLAGS, "--dataset", "chat",
                   "--num-prompts", "3", "--output-len", "4", "--no-breakdown", "--warmup-prompts", "0",
                   "--json", out], out)
    assert report["num_requests"] == 3 and report["output_tokens"] == 12 and report["breakdown"] is None
    assert report["prompt_tokens"] > 3 * 10  # templated conversations


def test_throughput_versus_no_speculation_on_the_code_edit_prompts(llama_dir, tmp_path, capsys):
    out = str(tmp_path / "tp.json")
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    report = _run(["bench", "throughput", "--model", llama_dir, *ENGINE_FLAGS, "--max-model-len", "512",
                   "--dataset", "code-edit", "--num-prompts", "3", "--output-len", "24", "--warmup-prompts", "1",
                   "--speculative-config", spec, "--versus-no-speculation", "--no-breakdown", "--json", out], out)
    with_spec, without = report["speculative"], report["no_speculation"]
    assert len(with_spec) == len(without) == 2  # A B B A
    assert all(run["output_tokens"] == 72 for run in with_spec + without)
    rate = lambda runs: sum(r["output_tokens"] for r in runs) / sum(r["elapsed_s"] for r in runs)  # noqa: E731
    assert report["speedup"] == pytest.approx(rate(with_spec) / rate(without))
    for run in with_spec:
        stats = run["spec_decoding"]
        assert stats["num_draft_tokens"] >= stats["num_accepted_tokens"] == sum(stats["num_accepted_tokens_per_pos"])
    assert all(run["spec_decoding"] is None for run in without)
    text = capsys.readouterr().out
    assert "mean acceptance length" in text and "the output tokens/s without it" in text
    assert main(["bench", "throughput", "--model", llama_dir, "--versus-no-speculation"]) == 1
    assert "--versus-no-speculation needs --speculative-config" in capsys.readouterr().err


def test_profiling_leaves_the_engine_as_it_was(llama_dir):
    from folio.bench.step_profile import profile_steps

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=4 << 20, num_threads=1)
    engine = llm.llm_engine
    before = {(id(o), k) for o in (engine, engine.scheduler, engine.runner, engine.runner.model,
                                   engine.runner.backend, engine.output_processor) for k in vars(o)}
    sampler = engine.runner.sampler
    with profile_steps(engine):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    after = {(id(o), k) for o in (engine, engine.scheduler, engine.runner, engine.runner.model,
                                  engine.runner.backend, engine.output_processor) for k in vars(o)}
    assert after == before and engine.runner.sampler is sampler


def _write_conversations(path: str) -> None:
    with open(path, "w") as f:
        for text in ("hello there", "what is a cat?", "tell me a story"):
            f.write(json.dumps({"messages": [{"role": "user", "content": text}], "output_len": 3}) + "\n")


def test_serve_against_a_running_server(llama_dir, tmp_path):
    result, png = str(tmp_path / "serve.json"), str(tmp_path / "serve.png")
    conversations = str(tmp_path / "chat.jsonl")
    _write_conversations(conversations)
    with running_server(llama_dir) as server:
        report = _run(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "5", "--input-len", "12",
                       "--output-len", "4", "--vocab-size", "512", "--request-rate", "50", "--result-file", result,
                       "--plot", png], result)
        chat = _run(["bench", "serve", "--base-url", server.base_url, "--model", MODEL_NAME, "--endpoint", "chat",
                     "--dataset", conversations, "--num-prompts", "4", "--max-concurrency", "2",
                     "--result-file", result], result)
    assert report["model"] == MODEL_NAME and report["request_rate"] == 50
    for r in (report, chat):
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        assert r["output_tokens"] == r["num_prompts"] * (4 if r is report else 3)
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        for name in ("ttft", "tpot", "itl", "e2e_latency"):
            assert set(r[name]) == SUMMARY_FIELDS, name
        assert r["ttft"]["max"] <= r["e2e_latency"]["max"]
        assert all(req["error"] is None and req["ttft_s"] <= req["latency_s"] for req in r["requests"])
    assert report["prompt_tokens"] == 5 * 12
    assert chat["max_concurrency"] == 2 and chat["endpoint"] == "chat"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_serve_refuses_remote_hosts_and_reports_failures(capsys):
    assert main(["bench", "serve", "--base-url", "http://example.com:8000"]) == 1
    assert "loopback" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--timeout", "5"]) == 1
    assert "cannot benchmark" in capsys.readouterr().err


def test_baseline_compares_with_transformers(llama_dir, tmp_path, capsys):
    out = str(tmp_path / "baseline.json")
    report = _run(["bench", "baseline", "--model", llama_dir, *ENGINE_FLAGS, "--num-prompts", "4", "--input-len",
                   "8", "--output-len", "3", "--hf-sequential-prompts", "2", "--hf-batch-sizes", "2,4,8",
                   "--json", out], out)
    assert report["sequential"]["measured_prompts"] == 2 and report["sequential"]["mode"] == "sequential"
    assert [r["batch"] for r in report["static"]] == [2, 4]  # 8 > --num-prompts is dropped
    best = max(report["static"], key=lambda r: r["output_tokens_per_s"])
    assert report["best_static"] == best
    for run in [report["sequential"], *report["static"]]:
        assert run["output_tokens"] == 12
        folio_rate = report["folio"]["output_tokens_per_s"]
        assert run["folio_speedup"] == pytest.approx(folio_rate / run["output_tokens_per_s"])
        assert run["other_cores"] >= 0
    assert report["folio"]["output_tokens"] == 12
    assert "transformers" in capsys.readouterr().out


@pytest.mark.parametrize("stored,dtype,held", [("bfloat16", "float32", "bfloat16"), ("float32", "float32", "float32"),
                                               ("bfloat16", "bfloat16", "bfloat16"), (None, "float32", "float32")])
def test_roofline_counts_weights_in_the_dtype_a_run_holds_them(llama_dir, stored, dtype, held):
    """A float32 run of a bf16 checkpoint holds its weights in bf16 (folio.models.bf16_valued): its decode streams
    2 bytes a weight, and the bound counts them so; the KV cache stays in the run's dtype."""
    import torch

    from folio.bench import roofline

    cfg = roofline.read_model_config(llama_dir)
    cfg.hf_config = {k: v for k, v in cfg.hf_config.items() if k not in ("torch_dtype", "dtype")}
    if stored is not None:
        cfg.hf_config["torch_dtype"] = stored
    cost = roofline.model_cost(cfg, getattr(torch, dtype))
    assert cost.weight_dtype == held
    assert cost.weight_bytes == getattr(torch, held).itemsize * cost.matmul_params
    assert cost.kv_bytes_per_token == getattr(torch, dtype).itemsize * 2 * 2 * 2 * 16


def test_roofline_with_small_buffers(llama_dir, tmp_path):
    out = str(tmp_path / "roofline.json")
    report = _run(["bench", "roofline", "--model", llama_dir, *ENGINE_FLAGS, "--num-prompts", "3", "--input-len",
                   "16", "--output-len", "4", "--bandwidth-mib", "4", "--matmul-m", "16", "--reps", "1", "--run",
                   "--json", out], out)
    limits, cost, bound = report["limits"], report["cost"], report["bound"]
    assert limits["bandwidth_gb_s"] > 0 and set(limits["peak_gflops"]) == {"float32"}
    assert len(limits["bandwidth_readings"]) == 2 and limits["bandwidth_gb_s"] == max(limits["bandwidth_readings"])
    assert all(set(r["gflops"]) == {"float32"} for r in limits["matmul"]) and limits["other_cores"] >= 0
    assert {r["name"] for r in limits["matmul"]} == {"qkv", "o", "gate_up", "down", "lm_head"}
    # the tiny llama: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512, 2 layers
    assert cost["lm_head_params"] == 64 * 512
    assert cost["matmul_params"] == 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 64 * 512
    assert cost["weight_bytes"] == 4 * cost["matmul_params"] and cost["kv_bytes_per_token"] == 4 * 2 * 2 * 2 * 16
    assert bound["batch"] == 3 and bound["waves"] == 1 and bound["decode_steps"] == 3
    assert bound["total_s"] == pytest.approx(bound["prefill_s"] + bound["decode_s"])
    assert bound["output_tokens_per_s"] == pytest.approx(12 / bound["total_s"])
    assert bound["decode_batch1"]["tokens_per_s"] <= bound["decode_step"]["tokens_per_s"]
    assert report["achieved_output_tokens_per_s"] == report["throughput"]["output_tokens_per_s"]
    assert report["achieved_fraction"] == pytest.approx(report["achieved_output_tokens_per_s"]
                                                        / bound["output_tokens_per_s"])


def test_make_model_writes_a_loadable_folder(tmp_path, capsys):
    out = str(tmp_path / "model")
    overrides = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 700, "max_position_embeddings": 256}
    assert main(["bench", "make-model", "--arch", "qwen2-0.5b", "--out", out,
                 *[a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]]) == 0
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert {k: cfg[k] for k in overrides} == overrides and cfg["eos_token_id"] == 699
    llm = LLM(out, dtype="float32", kv_cache_memory=1 << 20, num_threads=1)
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer.encode("Explain photosynthesis to a ten-year-old.")) > 0
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert tokenizer.decode(list(range(690))) and tokenizer.decode([699]) == ""  # every id decodes; specials skip
    out_ids = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert len(out_ids) == 3
    assert "qwen2-0.5b" in capsys.readouterr().out


def test_moe_benchmark_models_load_with_the_same_active_size(tmp_path):
    small = {"num_hidden_layers": 1, "vocab_size": 600, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
             "num_key_value_heads": 2, "moe_intermediate_size": 32, "intermediate_size": 64}
    for arch in ("qwen3-moe-small", "qwen3-moe-small-dense"):
        out = str(tmp_path / arch)
        assert main(["bench", "make-model", "--arch", arch, "--out", out,
                     *[a for k, v in small.items() for a in ("--set", f"{k}={v}")]]) == 0
        llm = LLM(out, dtype="float32", kv_cache_memory=1 << 20, num_threads=1)
        assert len(llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
    moe, dense = ARCHITECTURES["qwen3-moe-small"], ARCHITECTURES["qwen3-moe-small-dense"]
    assert moe["num_experts_per_tok"] * moe["moe_intermediate_size"] == dense["intermediate_size"]


def test_qwen2_architecture_has_the_issue_s_shapes():
    shapes = weight_shapes(ARCHITECTURES["qwen2-0.5b"])
    params = sum(math.prod(s) for s in shapes.values())
    assert params == 494_032_768  # Qwen2.5-0.5B with tied embeddings
    assert shapes["model.layers.23.self_attn.k_proj.weight"] == (128, 896) and "lm_head.weight" not in shapes


@pytest.mark.parametrize("benchmark", ["throughput", "serve", "baseline", "roofline", "make-model"])
def test_bench_help(benchmark, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", benchmark, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: folio bench {benchmark}")
    if benchmark in ("throughput", "baseline", "roofline"):
        assert "--max-num-seqs" in text and "--num-prompts" in text
