"""The offline API end to end: output shapes, n samples, seeds, stop strings, chat, tokenizer, priority."""

from __future__ import annotations

import pytest

from folio import LLM, CompletionOutput, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22)


def test_output_shapes_and_input_order(llm):
    prompts = ["hello world", {"prompt_token_ids": [5, 6, 7]}, "The quick brown fox"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello world", None, "The quick brown fox"]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("hello world")
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        comp = out.outputs[0]
        assert isinstance(comp, CompletionOutput) and comp.index == 0 and comp.logprobs is None
        assert comp.text == llm.get_tokenizer().decode(comp.token_ids)
        assert comp.finish_reason in ("stop", "length")


def test_n_samples_and_seeds_independent_of_batch(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    texts = {tuple(c.token_ids) for c in alone.outputs}
    assert len(texts) == 3, "the n samples are independent"
    crowd = [{"prompt_token_ids": [1 + i, 2, 3]} for i in range(5)]
    mixed = llm.generate(crowd[:2] + [{"prompt_token_ids": [9, 8, 7, 6]}] + crowd[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [params]
                         + [SamplingParams(temperature=0.7, seed=5, max_tokens=7)] * 3, use_tqdm=False)[2]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]


def test_stop_strings_never_in_text(llm):
    free = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[5:8]
    assert len(stop) == 3
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]
    kept = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[:free.text.index(stop) + 3]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.pool.num_blocks


def test_stop_token_ids_and_ignore_eos(llm):
    free = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0, max_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    target = free.token_ids[3]
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                       SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.token_ids == free.token_ids[:free.token_ids.index(target) + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == target


def test_chat_applies_template(llm):
    conv = [{"role": "user", "content": "hello"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                              add_special_tokens=False)
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]],
                   SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(two) == 2 and len(two[1].prompt_token_ids) > len(two[0].prompt_token_ids)


def test_chat_takes_vllms_tools_prefill_and_template(llm):
    """LLM.chat as vLLM's: tools reach the template, continue_final_message continues the assistant's prefill, and
    a chat_template of the caller's renders instead of the model's."""
    tok, params = llm.get_tokenizer(), SamplingParams(temperature=0, max_tokens=2)
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if tools %}"
                "{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=template,
                   tools=tools)[0]
    expected = '[user]hi[{"type": "function", "function": {"name": "get_time"}}][assistant]'
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    prefill = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The answer is"}]
    out = llm.chat(prefill, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nThe answer is"
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(prefill, params, use_tqdm=False, continue_final_message=True)


def test_tokenizer_round_trip(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "The quick brown fox"


def test_priority_policy_serves_high_priority_first(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    for rid, prio in (("low", 9), ("high", 0), ("mid", 5)):
        engine.add_request(rid, {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_abort_frees_blocks_and_reports(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(5, 45))}, SamplingParams(n=2, max_tokens=50))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.pool.num_blocks
    final = engine.abort_request("a")
    assert [c.finish_reason for c in final[0].outputs] == ["abort", "abort"] and final[0].finished
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_blocks
    assert engine.step() == []
