"""float32 layers of bf16 values keep their weights as bf16 blocks (folio.models.bf16_valued): the kernel's results
bit for bit the float32 blocks', every batch size served, and a bf16 checkpoint run in float32 generating what
Transformers does in float32."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_model, hf_greedy_logprobs, write_tokenizer
from folio import LLM, SamplingParams
from folio.models import bf16_valued, packed_scratch, small_batch_gemm
from folio.models.dense_linear import DenseLinearMethod
from folio.models.layers import Embedding
from folio.models.weight_loader import weight_loader_of
from folio.models.linear import Linear

pytestmark = pytest.mark.skipif(not small_batch_gemm.available(torch.float32),
                                reason="the float32 small-batch kernel is not built here")


def float32_blocks(w: torch.Tensor, width: int = 64, padded_k: int = 0) -> small_batch_gemm.PackedWeight:
    """w [N, K] as float32 blocks [ceil(N / width), K', width, 1] (the layout oneDNN gives float32 weights)."""
    n, k = w.shape
    num_blocks = -(-n // width)
    plain = torch.zeros(num_blocks * width, max(k, padded_k))
    plain[:n, :k] = w
    blocks = plain.view(num_blocks, width, -1, 1).transpose(1, 2).contiguous()
    return small_batch_gemm.PackedWeight(blocks, n, k)


def bf16_values(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


@pytest.mark.parametrize("check_bytes", [bf16_valued.CHECK_BYTES, 1])  # one piece, or a block at a time
@pytest.mark.parametrize("n,k", [(128, 40), (150, 96), (5, 64)])  # whole blocks, a partial last one, one block
def test_only_weights_of_bf16_values_are_narrowed_into_onednns_float32_layout(check_bytes, n, k, monkeypatch):
    monkeypatch.setattr(bf16_valued, "CHECK_BYTES", check_bytes)
    w = bf16_values(n, k)
    if packed_scratch.for_shape(n, k, torch.float32) is None:
        assert bf16_valued.narrowed(w) is None  # no scratch oneDNN's GEMM could take: stays float32
        pytest.skip("oneDNN packs float32 weights here in a layout folio does not recognise")
    narrow = bf16_valued.narrowed(w)
    assert narrow.blocks.dtype == torch.bfloat16 and narrow.dtype == torch.float32
    packed = small_batch_gemm.packed_blocks(torch.ops.mkldnn._reorder_linear_weight(w, 64), w)
    if packed is not None:  # oneDNN's own float32 blocks, where the kernel reads them: the same, value for value
        assert torch.equal(narrow.blocks.float(), packed.blocks)
    ids = torch.arange(n)
    assert torch.equal(small_batch_gemm.weight_rows(narrow, ids), w)  # the rows come back as float32
    assert torch.equal(bf16_valued.narrowed(w.to(torch.bfloat16)).blocks, narrow.blocks)  # as loaded in bf16
    w[n - 1, k // 2] += 2.0 ** -20  # one value that bf16 cannot hold, in the last block
    assert bf16_valued.narrowed(w) is None


# rows: one at a time (1, 2), tiles on the vectors as loaded (3-13), tiles on widened pieces (14 on), 64 the most;
# K: one piece, pieces of 64 (widened) and 128 (as loaded) with a partial last one, K padded in the blocks;
# blocks 64 columns wide, or narrower (single vectors past the last span of two)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, 14, 31, 64])
@pytest.mark.parametrize("k,padded_k", [(40, 0), (200, 0), (300, 320)])
@pytest.mark.parametrize("width,with_bias", [(64, False), (64, True), (48, True), (16, False)])
def test_the_kernel_on_bf16_blocks_gives_the_float32_blocks_results_bit_for_bit(m, k, padded_k, width, with_bias):
    n = 150  # whole blocks and a partial one
    weight = float32_blocks(bf16_values(n, k), width=width, padded_k=padded_k)
    narrow = small_batch_gemm.PackedWeight(weight.blocks.to(torch.bfloat16), n, k)
    x = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m + k))[:, ::2]  # strided rows
    if m % 2:
        x = x.contiguous()
    bias = torch.randn(n) if with_bias else None
    got = small_batch_gemm.linear(x, narrow, bias)
    assert torch.equal(got, small_batch_gemm.linear(x, weight, bias))
    assert torch.allclose(got, x @ weight.blocks[:, :k].transpose(1, 2).reshape(-1, k)[:n].T
                          + (bias if with_bias else 0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scratch", [True, False])
def test_batches_past_the_kernels_rows_go_to_the_scratch_or_to_the_kernel_in_pieces(scratch, monkeypatch):
    """Past MAX_ROWS: oneDNN's float32 GEMM on the shape's packed scratch, the blocks widened into it; without
    one (a shape too large), the kernel MAX_ROWS rows at a time. Any leading dims."""
    n, k = 100, 96
    w = bf16_values(n, k)
    if scratch and packed_scratch.for_shape(n, k, torch.float32) is None:
        pytest.skip("oneDNN packs float32 weights here in a layout folio does not recognise")
    if not scratch:  # as for a shape too large for one
        monkeypatch.setitem(packed_scratch.MAX_BYTES, torch.float32, 0)
    narrow = bf16_valued.narrowed(w)
    if not scratch:
        monkeypatch.setattr(packed_scratch, "for_shape", lambda *shape: None)
    calls = []
    real = small_batch_gemm.linear
    monkeypatch.setattr(small_batch_gemm, "linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    limit = small_batch_gemm.MAX_ROWS[torch.float32]
    bias = torch.randn(n)
    x = torch.randn(3, limit, k)  # 3 * limit rows
    got = bf16_valued.linear(x, narrow, bias)
    assert got.shape == (3, limit, n)
    assert torch.allclose(got, x @ w.T + bias, rtol=1e-5, atol=1e-4)
    assert calls == ([] if scratch else [limit] * 3)
    if scratch:  # the scratch holds this weight widened now (not written again for it); another weight of the
        # shape writes its own, and the first writes its own back
        held = packed_scratch.for_shape(n, k, torch.float32)
        assert held.holding() is narrow.blocks
        other = bf16_values(n, k, seed=1)
        other_narrow = bf16_valued.narrowed(other)
        assert torch.allclose(bf16_valued.linear(x, other_narrow, None), x @ other.T, rtol=1e-5, atol=1e-4)
        assert held.holding() is other_narrow.blocks
        assert torch.allclose(bf16_valued.linear(x, narrow, bias), x @ w.T + bias, rtol=1e-5, atol=1e-4)


def test_a_dense_float32_layer_of_bf16_values_keeps_only_the_bf16_blocks():
    layer = Linear(100, 48, bias=True, params_dtype=torch.float32)
    layer.bind(DenseLinearMethod())
    weight = bf16_values(48, 100)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(torch.randn(48))
    layer.method.process_weights_after_loading(layer)
    if layer.small_batch_weight is None:
        pytest.skip("oneDNN packs float32 weights here in a layout the kernel does not read")
    assert layer.weight is None and layer.packed is None
    assert layer.small_batch_weight.blocks.dtype == torch.bfloat16
    for m in (1, 64, 65, 300):
        x = torch.randn(m, 100)
        assert torch.allclose(layer(x), x @ weight.T + layer.bias, rtol=1e-5, atol=1e-4)


def test_a_float32_embedding_keeps_a_bf16_table_in_bf16_unless_a_tied_head_shares_it():
    """Untied: the table turns bf16 and lookups come back in float32, the same values; a float32 tensor keeps it
    float32. Tied: the head's method decides (a head without the dense method's loader reads it in float32)."""
    table = bf16_values(50, 24)
    untied = Embedding(50, 24)
    untied.weight.weight_loader(untied.weight, table.to(torch.bfloat16), None)
    assert untied.weight.dtype == torch.bfloat16
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    rows = untied(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, table[ids])
    from_float32 = Embedding(50, 24)
    from_float32.weight.weight_loader(from_float32.weight, table, None)
    assert from_float32.weight.dtype == torch.float32 and torch.equal(from_float32(ids), table[ids])
    widened = torch.randn(50, 24)  # a later tensor of another dtype widens the table back, exactly
    untied.weight.weight_loader(untied.weight, widened, None)
    assert untied.weight.dtype == torch.float32 and torch.equal(untied(ids), widened[ids])
    cast = Embedding(50, 24).to(torch.bfloat16)  # a cast module returns rows in its new dtype
    assert cast(ids).dtype == torch.bfloat16
    tied = Embedding(50, 24)
    Linear(24, 50, tied_to=tied.weight, params_dtype=torch.float32)  # not bound: no dense loader around it
    tied.weight.weight_loader(tied.weight, table.to(torch.bfloat16), None)
    assert tied.weight.dtype == torch.float32 and torch.equal(tied(ids), table[ids])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a bf16 model's table is bf16 whatever the checkpoint's dtype
    try:
        in_bf16 = Embedding(50, 24)
    finally:
        torch.set_default_dtype(previous)
    weight_loader_of(in_bf16.weight)(in_bf16.weight, table, None)
    assert in_bf16.weight.dtype == torch.bfloat16 and in_bf16(ids).dtype == torch.bfloat16


def test_the_loader_keeps_bf16_tensors_and_widens_a_weight_given_another_dtype():
    """A float32 layer's weight turns bf16 at a first bf16 tensor and back to float32, exactly, at a shard of
    another dtype; a first float32 tensor keeps it float32. Processing narrows bf16 values, widens the rest."""
    bound = []
    for dtypes in [("bf16", "bf16"), ("bf16", "f32"), ("f32", "bf16")]:
        layer = Linear(64, {"a": 32, "b": 32}, params_dtype=torch.float32)
        layer.bind(DenseLinearMethod())
        shards = {"a": bf16_values(32, 64, seed=1), "b": bf16_values(32, 64, seed=2)}
        for shard_id, dtype in zip(shards, dtypes):
            tensor = shards[shard_id] if dtype == "f32" else shards[shard_id].to(torch.bfloat16)
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        expected = torch.bfloat16 if dtypes == ("bf16", "bf16") else torch.float32
        assert layer.weight.dtype == expected
        assert torch.equal(layer.weight.float(), torch.cat(list(shards.values())))
        bound.append((layer, torch.cat(list(shards.values()))))
    for layer, weight in bound:
        layer.method.process_weights_after_loading(layer)
        assert layer.weight is None and layer.small_batch_weight.blocks.dtype == torch.bfloat16
        x = torch.randn(3, 64)
        assert torch.allclose(layer(x), x @ weight.T, rtol=1e-5, atol=1e-4)
    # a bf16-kept weight that is not narrowed (no kernel) goes back to float32 before the usual processing
    layer = Linear(64, 32, params_dtype=torch.float32)
    layer.bind(DenseLinearMethod())
    layer.weight.weight_loader(layer.weight, bf16_values(32, 64).to(torch.bfloat16), None)
    assert layer.weight.dtype == torch.bfloat16
    original = bf16_valued.available
    try:
        bf16_valued.available = lambda: False
        layer.method.process_weights_after_loading(layer)
    finally:
        bf16_valued.available = original
    assert layer.small_batch_weight is None or layer.small_batch_weight.blocks.dtype == torch.float32
    x = torch.randn(2, 64)
    assert layer(x).dtype == torch.float32 and torch.allclose(layer(x), x @ bf16_values(32, 64).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True), ("phi3", False), ("mixtral", False)])
def test_a_bf16_checkpoint_in_float32_generates_what_transformers_does(tmp_path, arch, tie):
    """Weights as stored in bf16, run in float32 (the default on CPUs without fast bf16): loaded as bf16, the
    layers keep bf16 blocks, a tied embedding looks its rows up in the lm_head's, an untied one keeps its table in
    bf16, fused experts are stacked in bf16, and greedy tokens and logprobs are Transformers' in float32 on the
    same checkpoint, prompts of more than the kernel's rows included."""
    import transformers

    folder = build_tiny_model(str(tmp_path / "f32"), arch, tie=tie)
    bf16_folder = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(bf16_folder)
    write_tokenizer(bf16_folder)
    llm = LLM(bf16_folder, dtype="float32", kv_cache_memory=1 << 22)
    model = llm.llm_engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.small_batch_weight.blocks.dtype == torch.bfloat16 for m in layers)
    # an untied embedding's table and fused experts stay bf16 too; the norms are float32
    table = model.embed_tokens.weight
    assert table is None if tie else table.dtype == torch.bfloat16
    experts = [p for name, p in model.named_parameters() if name.endswith((".w13", ".w2"))]
    assert (arch == "mixtral") == bool(experts) and all(p.dtype == torch.bfloat16 for p in experts)
    assert all(p.dtype == torch.float32 for name, p in model.named_parameters() if "norm" in name)
    prompts = [[5, 6, 7, 8, 9], [(7 * i) % 400 + 3 for i in range(150)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = hf_greedy_logprobs(bf16_folder, prompt, 12)
        assert output.outputs[0].token_ids == tokens
        got = [step[t].logprob for step, t in zip(output.outputs[0].logprobs, tokens)]
        assert got == pytest.approx(logprobs, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "w8a16", "int4"])
def test_a_quantised_tied_head_leaves_a_bf16_table_in_bf16_with_the_float32_tables_results(tmp_path, quantization):
    """A tied lm_head quantised on load reads the table in float32, and lookups widen its rows: a float32 model of a
    bf16 checkpoint keeps the table in bf16 and gives, logprob for logprob, what the same values stored in float32
    give (the rescored int4 head, where the CPU has it, recomputes its top logits from the bf16 table)."""
    import transformers

    folder = build_tiny_model(str(tmp_path / "f32"), "llama", tie=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    folders = {}
    for dtype in (torch.bfloat16, torch.float32):  # the same bf16 values, stored in each dtype
        folders[dtype] = str(tmp_path / str(dtype)[6:])
        model.to(dtype).save_pretrained(folders[dtype])
        write_tokenizer(folders[dtype])
    prompts = [[5, 6, 7, 8, 9], [(7 * i) % 400 + 3 for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    results = {}
    for dtype, path in folders.items():
        llm = LLM(path, dtype="float32", quantization=quantization, kv_cache_memory=1 << 22)
        table = llm.llm_engine.runner.model.embed_tokens.weight
        assert table.dtype == dtype
        exact_table = getattr(llm.llm_engine.runner.model.lm_head, "exact_table", None)
        assert exact_table is None or exact_table.data_ptr() == table.data_ptr()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[dtype] = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]
    assert results[torch.bfloat16] == results[torch.float32]
