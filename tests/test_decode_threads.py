"""The decode threads (folio.platforms.decode_threads): the kernels compute the same numbers on them as on
OpenMP, whatever weights were prefetched before a call, from any thread and in a forked child, and an engine's
steps of one token run on them."""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

import pytest
import torch

from folio import LLM, SamplingParams
from folio.models import int4_blocks, int8_blocks, onednn_int8, quant_kernels, small_batch_gemm
from folio.models import quant_reference as ref
from folio.platforms import decode_threads

pytestmark = pytest.mark.skipif(decode_threads.KERNEL.load() is None or len(os.sched_getaffinity(0)) < 2,
                                reason="the decode threads need their kernel and two cores")


@pytest.fixture(autouse=True)
def two_threads():
    """The tests' processes run one torch thread (conftest); a step's threads are what the decode threads take."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def decode_step():
    """Within: the threads of a step of one token."""
    return decode_threads.threads_for_step(1)


def _bf16_layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = small_batch_gemm.packed_blocks(torch.ops.mkldnn._reorder_linear_weight(w, 64), w)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return lambda x: small_batch_gemm.linear(x, packed, bias)


def _int4_layer(n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    blocks = int4_blocks.pack(*ref.quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32), dtype)
    bias = torch.randn(n, generator=g)
    return lambda x: int4_blocks.linear(x, blocks, bias)


def _int4_f32_layer(n: int, k: int, seed: int):
    return _int4_layer(n, k, seed, torch.float32)


def _int8_f32_layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = int8_blocks.pack(*ref.quantize_int8(torch.randn(n, k, generator=g) * 0.05, 32))
    bias = torch.randn(n, generator=g)
    return lambda x: int8_blocks.linear(x, blocks, bias)


def _w8a8_layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = onednn_int8.prepack(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                                 torch.rand(n, generator=g) * 0.01 + 1e-3)
    bias = torch.randn(n, generator=g)
    return lambda x: quant_kernels.w8a8_packed_linear(x, packed.blocks, packed.column_sums, packed.scales, bias,
                                                      True)


# kind: (layer maker, whether its kernel runs here, the activations' dtype); the float32 block kernels are the
# ones AVX2 CPUs without AVX-512 run
LAYERS = {
    "bf16": (_bf16_layer, small_batch_gemm.available(torch.bfloat16), torch.bfloat16),
    "int4": (_int4_layer, int4_blocks.available(torch.bfloat16), torch.bfloat16),
    "w8a8": (_w8a8_layer, quant_kernels.has_packed_w8a8() and onednn_int8.available(), torch.bfloat16),
    "int4-f32": (_int4_f32_layer, int4_blocks.available(torch.float32), torch.float32),
    "int8-f32": (_int8_f32_layer, int8_blocks.available(torch.float32), torch.float32),
}
# a decoder layer's shapes (Qwen2-0.5B's), an odd one, and one too small to split
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (333, 96), (64, 64)]


def _layers(kind: str):
    make, available, _ = LAYERS[kind]
    if not available:
        pytest.skip(f"the {kind} kernel does not run on this CPU")
    return [make(n, k, seed=i) for i, (n, k) in enumerate(SHAPES)]


def _any_kind() -> str:
    """The first kind whose kernel runs here, for the tests of the threads themselves."""
    kind = next((kind for kind, (_, available, _) in LAYERS.items() if available), None)
    if kind is None:
        pytest.skip("no kernel that runs on the decode threads runs on this CPU")
    return kind


def _rows_and_results(kind: str, layers):
    """A row for each layer and its product on OpenMP, the results every other path must give."""
    xs = [torch.randn(1, k).to(LAYERS[kind][2]) for _, k in SHAPES]
    return xs, [layer(x) for layer, x in zip(layers, xs)]


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_cycle_of_layers_gives_openmps_results_on_every_pass(kind):
    """Passes over the layers in order, as decode steps make them: from the second pass on, each call's workers
    prefetched their share of it during the call before and took more blocks; the results stay the same."""
    layers = _layers(kind)
    xs, want = _rows_and_results(kind, layers)
    with decode_step():
        assert torch.get_num_threads() == 1  # torch's own operators stay off the cores the workers spin on
        for _ in range(4):
            for layer, x, expected in zip(layers, xs, want):
                assert torch.equal(layer(x), expected)
    assert torch.get_num_threads() == 2


def test_steps_of_more_tokens_keep_openmp():
    threads = torch.get_num_threads()
    with decode_threads.threads_for_step(2):
        assert torch.get_num_threads() == threads
        assert decode_threads.KERNEL.load().threads() == 0
    with decode_step():
        assert decode_threads.KERNEL.load().threads() == threads
    assert decode_threads.KERNEL.load().threads() == 0


def test_calls_from_other_threads_during_a_step_compute_alike():
    """A call from a second Python thread while the workers run another's runs inline: same results."""
    kind = _any_kind()
    layers = _layers(kind)
    xs, want = _rows_and_results(kind, layers)
    errors: list[str] = []

    def run() -> None:
        for _ in range(20):
            for i, (layer, x) in enumerate(zip(layers, xs)):
                if not torch.equal(layer(x), want[i]):
                    errors.append(f"layer {i}")

    with decode_step():
        others = [threading.Thread(target=run) for _ in range(2)]
        for t in others:
            t.start()
        run()
        for t in others:
            t.join()
    assert not errors


def _in_forked_child(target, kind: str):
    """What target(kind, queue) puts in its queue, run in a forked child; fails if the child hangs (a lost wakeup,
    threads waited for that the fork did not copy) or dies."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(kind, queue))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the child hung or failed"
    return queue.get(timeout=5)


def _child(kind: str, queue) -> None:
    torch.set_num_threads(1)  # GNU OpenMP's thread team does not survive a fork either: no parallel region here
    layers = _layers(kind)
    xs, want = _rows_and_results(kind, layers)
    torch.set_num_threads(2)  # what the decode threads take over (within, torch's own count is one)
    with decode_step():
        queue.put(all(torch.equal(layer(x), w) for layer, x, w in zip(layers, xs, want)))


def test_a_forked_child_starts_threads_of_its_own():
    """A child forked from a process whose workers run has none of them: it must not wait for them."""
    kind = _any_kind()
    layers = _layers(kind)
    with decode_step():
        layers[0](torch.randn(1, SHAPES[0][1]).to(LAYERS[kind][2]))  # the parent's workers exist
    assert _in_forked_child(_child, kind)


def _sleepers(kind: str, queue) -> None:
    torch.set_num_threads(1)  # as in _child: no OpenMP region before the fork's threads are gone
    layers = _layers(kind)
    xs, want = _rows_and_results(kind, layers)
    ext = decode_threads.KERNEL.load()
    ext.set_threads(2, idle_spin_us=0, join_spin_us=0)
    same = True
    for _ in range(30):
        for layer, x, expected in zip(layers, xs, want):
            time.sleep(2e-4)  # the worker goes to sleep between calls
            same &= torch.equal(layer(x), expected)
    ext.set_threads(0)
    queue.put(same)


def test_workers_and_a_main_thread_that_never_spin_lose_no_wakeup():
    """With no spinning at all, every worker sleeps between calls and the main thread sleeps on every join its
    worker has not finished: each call still returns (a lost wakeup would leave the child hanging) with OpenMP's
    results."""
    assert _in_forked_child(_sleepers, _any_kind())


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_an_engine_decodes_alike_on_either_threads(tiny_model_factory, monkeypatch, quantization):
    """Greedy tokens and their logprobs, batch 1, with steps of one token on the decode threads or on OpenMP. No
    prefix caching: a second pass would take the 17-token prompt's last token alone, whose row then goes through
    the one-row kernels instead of the 17-row matmul (on AMX the dequantised GEMM for int4), other roundings."""
    llm = LLM(tiny_model_factory("qwen2"), dtype="bfloat16", quantization=quantization, max_num_seqs=1,
              kv_cache_memory=1 << 24, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in (5, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logprobs=2)
    calls: list[int] = []
    step_threads = decode_threads.threads_for_step

    def counted(num_tokens: int):
        calls.append(num_tokens)
        return step_threads(num_tokens)

    monkeypatch.setattr(decode_threads, "threads_for_step", counted)

    def generate():
        return [(tuple(out.outputs[0].token_ids), [sorted(d.items()) for d in out.outputs[0].logprobs])
                for out in llm.generate(prompts, params, use_tqdm=False)]

    on = generate()
    assert calls.count(1) >= 2 * 11  # every decode step went through the decode threads' switch
    monkeypatch.setattr(decode_threads, "DECODE_TOKENS", 0)
    assert generate() == on
