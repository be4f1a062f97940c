"""Tensor parallelism: a model split over two worker processes (gloo) gives what one rank gives.

Two ranks sum their halves of every o_proj and down_proj in another order than one rank's matmul does, so
logprobs agree to float32 rounding, and greedy tokens (random weights, float32) are equal. Random sampling
too: every rank must draw the same tokens, or the next step's inputs (each rank appends its own samples) would
differ between ranks and the sums would be of different tokens.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from conftest import build_tiny_model, hf_greedy
from folio import LLM, SamplingParams
from folio.distributed import parallel_state
from folio.distributed.parallel_state import TensorParallelGroup
from folio.executor.executor import WorkerError
from folio.models.dense_linear import DenseLinearMethod
from folio.models.linear import Linear
from folio.models.model_config import ModelConfig
from folio.models.weight_loader import ALL_SHARDS, weight_loader_of
from folio.pooling_params import PoolingParams
from folio.structured_output.params import StructuredOutputsParams
from test_gemma import build_gemma

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 300, 301]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
ENGINE = dict(dtype="float32", kv_cache_memory=32 << 20, max_model_len=256)


def _run(folder: str, params, ranks: int, prompts=PROMPTS, **kwargs):
    llm = LLM(folder, tensor_parallel_size=ranks, **ENGINE, **kwargs)
    try:
        return [(out.outputs[0].token_ids, out.outputs[0].logprobs)
                for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    finally:
        llm.llm_engine.shutdown()


def _assert_same(one, two) -> None:
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two):
        assert tokens2 == tokens1
        for step1, step2, token in zip(logprobs1 or [], logprobs2 or [], tokens1):
            assert math.isclose(step1[token].logprob, step2[token].logprob, rel_tol=1e-4, abs_tol=1e-4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    def build(name: str) -> str:
        folder = str(tmp_path_factory.mktemp(name))
        if name == "gemma3-bias":  # o_proj has a bias: a row-parallel layer adds it once
            return build_gemma(folder, "gemma3", attention_bias=True)
        return build_tiny_model(folder, name, tie=name == "llama")
    return build


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3-bias"])
def test_two_ranks_give_one_ranks_greedy_tokens(folders, arch):
    """Llama tied, Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused checkpoint tensors, Gemma 3's
    o_proj bias and sliding layers."""
    folder = folders(arch)
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_fewer_kv_heads_than_ranks_are_shared(tmp_path, arch):
    """Four ranks over two KV heads: each keeps one, which two ranks' query heads read (Phi-3: cut from its fused
    q/k/v tensor)."""
    folder = build_tiny_model(str(tmp_path), arch)
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 4))


def test_two_ranks_match_transformers(folders):
    folder = folders("llama")
    outputs = _run(folder, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), 2)
    for prompt, (tokens, _) in zip(PROMPTS, outputs):
        assert tokens == hf_greedy(folder, prompt, 16)


def test_ranks_sample_alike(folders):
    """Seeded requests, and unseeded ones drawing from the engine's seed, sample what one rank samples."""
    folder = folders("qwen2")
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7 + i)
              for i in range(len(PROMPTS))]
    unseeded = SamplingParams(temperature=1.2, max_tokens=24, ignore_eos=True)
    for params in (seeded, unseeded):
        one, two = _run(folder, params, 1), _run(folder, params, 2)
        assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]


def test_structured_outputs_and_speculation_over_two_ranks(folders):
    """The grammar's bitmask and n-gram drafts reach every rank in the step's message."""
    folder = folders("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    repetitive = [[7, 8, 9, 10] * 6, list(range(30, 50)) * 2, [5, 6, 7, 8, 9]]
    for kwargs in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        one = _run(folder, params, 1, repetitive, **kwargs)
        two = _run(folder, params, 2, repetitive, **kwargs)
        assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]


def test_embeddings_over_two_ranks(folders):
    folder = folders("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    vectors = []
    for ranks in (1, 2):
        llm = LLM(folder, tensor_parallel_size=ranks, **ENGINE)
        vectors.append([out.outputs.embedding for out in llm.embed(prompts, PoolingParams())])
        llm.llm_engine.shutdown()
    assert torch.allclose(torch.tensor(vectors[0]), torch.tensor(vectors[1]), atol=1e-5)


def test_int8_quantised_as_it_loads_over_two_ranks(folders):
    """A method that quantises as it loads gets each rank's slice. int8 of halves of down_proj's rows is not int8
    of whole rows, so the logprobs are int8's (on this random model up to 0.35 from float32's on one rank too),
    not float32's; a wrong slice would be nats off."""
    folder = folders("llama")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    errors = []
    for (_, dense), (_, int8) in zip(_run(folder, params, 1), _run(folder, params, 2, quantization="int8")):
        shared = set(dense[0]) & set(int8[0])
        assert len(shared) >= 3
        errors += [abs(dense[0][token].logprob - int8[0][token].logprob) for token in shared]
    assert 1e-3 < sum(errors) / len(errors) < 0.2 and max(errors) < 0.5


def test_a_worker_that_dies_fails_the_engine_instead_of_hanging(folders):
    llm = LLM(folders("llama"), tensor_parallel_size=2, **ENGINE)
    worker = llm.llm_engine.executor.processes[1]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(WorkerError, match="worker 1 exited"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert not any(p.is_alive() for p in llm.llm_engine.executor.processes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide the model's num_attention_heads"),
    (dict(tensor_parallel_size=8), "tensor_parallel_size 8 does not divide the model's num_attention_heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "needs 'mp' or 'ray'"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "x",
                                                      "num_speculative_tokens": 2}), "'draft_model' is not supported"),
])
def test_refusals(folders, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(folders("llama"), **{**ENGINE, **kwargs})


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_mixtures_of_experts_split_every_expert(folders, arch):
    """Each rank keeps its columns of every expert (and of Qwen2-MoE's shared expert, its dense layer 1 too): the
    block sums the ranks' outputs once. The experts run fused here where the kernel builds (float32). OLMoE's q/k
    norms sum their squares across the ranks."""
    folder = folders(arch)
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


def test_experts_run_one_by_one_split_too(folders, monkeypatch):
    """Without the fused kernel each expert's layers run through their linear method, the down projections leaving
    their partial products to the block's one sum."""
    monkeypatch.setenv("FOLIO_DISABLE_CPU_KERNELS", "1")  # (read by the worker processes too)
    folder = folders("qwen2_moe")
    _assert_same(_run(folder, GREEDY, 1), _run(folder, GREEDY, 2))


def test_refused_splits(tiny_model_factory):
    experts = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 2, "num_experts_per_tok": 1,
               "moe_intermediate_size": 6}
    assert ModelConfig.from_hf_dict(experts).for_tensor_parallel(2).moe.intermediate_size == 3
    with pytest.raises(ValueError, match=r"does not divide the model's moe_intermediate_size \(5\)"):
        ModelConfig.from_hf_dict({**experts, "moe_intermediate_size": 5}).for_tensor_parallel(2)
    with pytest.raises(ValueError, match="GGUF file's layers as stored are not split"):
        LLM(None, tensor_parallel_size=2)


@pytest.mark.parametrize("fused", [False, True])
def test_each_rank_loads_its_slice(monkeypatch, fused):
    """Without processes: each rank's column-parallel q/k/v holds its rows of each shard (from separate tensors or
    one fused tensor), each rank's row-parallel layer its columns and the bias on rank 0 only; the ranks' partial
    products sum to the whole layer's."""
    torch.manual_seed(0)
    q, k, v, o, o_bias = (torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 8), torch.randn(6))
    x, y = torch.randn(3, 6), torch.randn(3, 8)
    qkv_out, o_out = [], []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(rank, 2))
        qkv = Linear(6, {"q": 4, "k": 2, "v": 2}, parallel="column")
        row = Linear(4, 6, bias=True, parallel="row")
        qkv.bind(DenseLinearMethod())
        row.bind(DenseLinearMethod())
        load = weight_loader_of(qkv.weight)
        pieces = [(torch.cat([q, k, v]), ALL_SHARDS)] if fused else [(q, "q"), (k, "k"), (v, "v")]
        for tensor, shard_id in pieces:
            if shard_id == ALL_SHARDS:
                for piece_id, (first, rows) in qkv.weight.shard_extents.items():
                    load(qkv.weight, tensor[first:first + rows], piece_id)
            else:
                load(qkv.weight, tensor, shard_id)
        weight_loader_of(row.weight)(row.weight, o, None)
        weight_loader_of(row.bias)(row.bias, o_bias, None)
        qkv_out.append(qkv.method.apply(qkv, x))
        o_out.append(row.method.apply(row, y[:, rank * 4:(rank + 1) * 4]))
    expected = torch.cat([x @ w.T for w in (q, k, v)], dim=1)  # q: columns 0-7, k: 8-11, v: 12-15
    assert torch.allclose(qkv_out[0], expected[:, [0, 1, 2, 3, 8, 9, 12, 13]], atol=1e-5)
    assert torch.allclose(qkv_out[1], expected[:, [4, 5, 6, 7, 10, 11, 14, 15]], atol=1e-5)
    assert torch.allclose(o_out[0] + o_out[1], y @ o.T + o_bias, atol=1e-5)
    with pytest.raises(ValueError, match="has 5 rows, expected 8"):
        weight_loader_of(qkv.weight)(qkv.weight, torch.randn(5, 6), "q")


def test_server_over_two_ranks(folders):
    """`folio serve --tensor-parallel-size 2`: answers as one rank does, streamed too, and its workers stop with it."""
    from server_fixture import MODEL_NAME, running_server

    folder = folders("llama")
    messages = [{"role": "user", "content": "hello there"}]
    answers = []
    for ranks in (1, 2):
        with running_server(folder, tensor_parallel_size=ranks) as server:
            client = server.openai()
            plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
            stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                    stream=True)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            assert streamed == plain.choices[0].message.content
            answers.append(plain.choices[0].message.content)
            processes = server.llm.engine.executor.processes if ranks == 2 else []
        for process in processes:
            process.join(timeout=10)
            assert not process.is_alive()
    assert answers[1] == answers[0]


def _hold_memory_and_spin(megabytes: int, ready, stop) -> None:
    held = bytearray(b"\x01" * (megabytes << 20))  # written: resident
    ready.set()
    while not stop.is_set():
        held[0] = (held[0] + 1) % 256


def test_the_benchmarks_count_live_worker_processes():
    """`bench throughput` with several ranks reports the workers' peak memory and CPU as its own, not as other
    processes' (which would mark every run noisy)."""
    import gc
    import multiprocessing
    import time

    from folio.bench import noise
    from folio.memory import peak_resident_bytes

    gc.collect()  # earlier tests' engines: their finalizers stop their workers, whose ending would skew the counts
    assert not multiprocessing.active_children()
    before_memory, before_cpu = peak_resident_bytes(), noise._own_seconds()
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    worker = context.Process(target=_hold_memory_and_spin, args=(300, ready, stop))
    worker.start()
    try:
        assert ready.wait(120), "the worker did not start"  # (a loaded machine spawns slowly)
        assert peak_resident_bytes() - before_memory >= 300 << 20
        deadline = time.monotonic() + 60
        while noise._own_seconds() - before_cpu < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.is_alive() and noise._own_seconds() - before_cpu >= 0.5  # its spinning, while it lives
    finally:
        stop.set()
        worker.join()


def test_throughput_bench_over_two_ranks(folders, tmp_path, capsys):
    import json

    from folio.cli import main

    out = str(tmp_path / "tp.json")
    assert main(["bench", "throughput", "--model", folders("llama"), "--dtype", "float32", "--kv-cache-memory",
                 str(32 << 20), "--tensor-parallel-size", "2", "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--warmup-prompts", "0", "--json", out]) == 0
    assert "step breakdown: off: the model runs in worker processes" in capsys.readouterr().out
    with open(out) as f:
        report = json.load(f)
    assert report["output_tokens"] == 12 and report["breakdown"] is None


def test_a_server_whose_worker_dies_reports_its_engine_dead(folders):
    """The request in flight fails with a 503, and /health says 503 from then on (or the server exits, by
    default: test_server_shutdown)."""
    import httpx

    from folio.entrypoints.openai.server_options import ServerOptions
    from server_fixture import MODEL_NAME, running_server

    with running_server(folders("llama"), options=ServerOptions(exit_on_engine_death=False),
                        tensor_parallel_size=2) as server:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        worker = server.llm.engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 503 and "worker 0 exited" in response.text
        assert httpx.get(server.base_url + "/health").status_code == 503


def test_an_error_in_a_step_ends_the_engine(folders):
    """A worker that raises in a step may leave the others in a collective: every worker stops, and the engine
    raises a WorkerError (which the async engine takes as its death), not the error as if it could go on."""
    from folio.core.step_contract import ScheduledRequestData, SchedulerOutput

    llm = LLM(folders("llama"), tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.executor
    with pytest.raises(WorkerError, match="(?s)worker [01] failed.*KeyError"):
        executor.execute(SchedulerOutput(scheduled=[ScheduledRequestData("never-added", 0, 1)]))
    assert not any(p.is_alive() for p in executor.processes)


def _all_reduce_both_ways(rank: int, size: int, port: int, failures) -> None:
    import torch.distributed as dist

    from folio.distributed.parallel_state import init_tensor_parallel, tensor_parallel_group

    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", "gloo")
    group = tensor_parallel_group()
    assert group.shared_memory is not None
    generator = torch.Generator().manual_seed(rank)
    shapes = [(1, 896), (16, 896), (3, 5), (64, 128)] * 25 + [(group.shared_memory.slot_bytes // 4 + 1,)]  # gloo's
    for i, shape in enumerate(shapes):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        x = torch.randn(shape, generator=generator).to(dtype)
        expected = x.float().clone()
        dist.all_reduce(expected)
        ours = group.all_reduce(x.clone())
        everyone = [torch.empty_like(ours) for _ in range(size)]
        dist.all_gather(everyone, ours)
        if not all(torch.equal(ours, other) for other in everyone):
            failures.put(f"rank {rank}: ranks differ at all-reduce {i}")
        if not torch.allclose(ours.float(), expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2):
            failures.put(f"rank {rank}: not the sum at all-reduce {i}")


def test_shared_memory_all_reduce_sums_alike_on_every_rank():
    """Three ranks on two cores (a waiting rank yields its core), float32 and bf16, shapes that change from call to
    call: every rank gets the same bits, and the sum; a tensor larger than a slot goes through gloo."""
    import multiprocessing

    from folio.distributed.placement import free_port

    context = multiprocessing.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_all_reduce_both_ways, args=(rank, 3, port, failures)) for rank in range(3)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0, 0]
    assert failures.empty(), failures.get()


def test_the_shared_buffer_fits_what_dev_shm_has_room_for(monkeypatch, tmp_path):
    """Slots shrink to a quarter of /dev/shm's free space, their pages reserved at start (a full tmpfs would kill a
    rank with SIGBUS mid-step); with no room for a MiB per slot, gloo serves every all-reduce."""
    from types import SimpleNamespace

    from folio.distributed import shm_all_reduce

    def free(megabytes: int) -> None:
        monkeypatch.setattr(shm_all_reduce.os, "statvfs",
                            lambda path: SimpleNamespace(f_bavail=megabytes << 8, f_frsize=4096))

    free(64)  # Docker's default /dev/shm
    path = str(tmp_path / "buffer")
    slot = shm_all_reduce._reserve(path, 2)
    assert slot == 4 << 20 and os.path.getsize(path) == 2 * 64 + 2 * 2 * slot
    os.unlink(path)
    free(1 << 10)
    assert shm_all_reduce._reserve(path, 2) == shm_all_reduce.SLOT_BYTES
    os.unlink(path)
    free(4)
    assert shm_all_reduce._reserve(path, 2) == 0 and not os.path.exists(path)
