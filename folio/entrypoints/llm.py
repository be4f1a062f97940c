"""LLM: the offline Python API, in vLLM's conventions (`LLM(...).generate(prompts, SamplingParams(...))`,
`LLM(...).embed(prompts)`)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from tqdm import tqdm

from folio.engine.input_processor import Params, PromptType
from folio.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.outputs import EmbeddingRequestOutput, EngineOutput, RequestOutput
from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer

Conversation = list[dict]


class LLM:
    """Offline batch generation. Every engine option (folio.config) is a keyword argument (dtype, block_size,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy, seed, ...)."""

    def __init__(self, model: Optional[str] = None, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_kwargs(model, **kwargs)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        return self._run(prompts, list(sampling_params), priority or [0] * len(prompts), use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Optional[PoolingParams] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (`.outputs.embedding`), pooled from the model's final hidden states as
        pooling_params says (default: the last token's, normalised); results come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(prompts, [pooling_params or PoolingParams()] * len(prompts), [0] * len(prompts), use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt; each output holds the beam_width best sequences, best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        processor = self.llm_engine.input_processor
        token_ids = [processor.process_prompt(p).prompt_token_ids for p in prompts]
        return beam_search(self.llm_engine, token_ids, params)

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list[dict]] = None,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`) to one conversation or a list of them, then
        generate, as vLLM's LLM.chat: `tools` (OpenAI's shape) reach the template; continue_final_message (with
        add_generation_prompt=False) continues the last message instead of starting a new turn."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template,
            continue_final_message=continue_final_message, **kwargs)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[Params], priority: list[int],
             use_tqdm: bool) -> list[EngineOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, priority=prio, output_kind=OutputKind.FINAL_ONLY)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # a bad prompt rejects the whole call, leaving nothing behind
            raise
        results: dict[str, EngineOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
