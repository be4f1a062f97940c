"""`make run`: generate with the embedded default model (SmolLM2-135M-Instruct) and print texts and throughput."""

from __future__ import annotations

import argparse
import time

from folio import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=64, help="prompts in the throughput run")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt in the throughput run")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model)
    print(f"loaded in {time.perf_counter() - start:.1f} s\n")

    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}\n")
    chat = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    print(f"chat {CHAT[0]['content']!r} -> {chat.outputs[0].text!r}\n")

    prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(args.batch)]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"throughput: {len(prompts)} prompts x {args.max_tokens} tokens: {generated} tokens in {elapsed:.1f} s "
          f"= {generated / elapsed:.1f} output tokens/s")


if __name__ == "__main__":
    main()
