"""The requests a benchmark sends: random token ids of fixed lengths, chat conversations, or texts.

Random prompts make lengths exact, so folio, Transformers and a server all see the same work; chat prompts
(`folio/bench/data/chat_prompts.jsonl`, synthetic, shipped here because nothing may be downloaded) give varied
lengths and shared system prompts, closer to real traffic. `code-edit` (`folio/bench/data/code_edit.jsonl`)
holds code-editing and quoting requests, chat conversations and plain texts, whose answers repeat much of
their prompt: the workload speculative decoding is for. Every choice is seeded (`--dataset-seed`), so two
runs, or two systems in one run, get the same requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
from dataclasses import dataclass
from typing import Iterator, Optional

from folio.tokenizer import Tokenizer

DATASETS = {"chat": os.path.join(os.path.dirname(__file__), "data", "chat_prompts.jsonl"),
            "code-edit": os.path.join(os.path.dirname(__file__), "data", "code_edit.jsonl")}
DEFAULT_OUTPUT_LEN = 128  # the random dataset's; chat conversations carry their own


@dataclass
class BenchRequest:
    output_len: int  # tokens to generate (EOS is ignored, so exactly this many)
    prompt_token_ids: Optional[list[int]] = None  # random prompts, and the others once tokenized
    messages: Optional[list[dict]] = None  # chat conversations
    text: Optional[str] = None  # plain-text prompts, sent without a chat template

    @property
    def prompt_text(self) -> str:
        """The prompt as one plain text, for a completions endpoint (a conversation's messages joined)."""
        return self.text if self.text is not None else "\n\n".join(m["content"] for m in self.messages or ())

    @property
    def chat_messages(self) -> list[dict]:
        """The prompt as a conversation, for a chat endpoint (a text becomes one user message)."""
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text or ""}]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", default="random",
                       help="'random' (random token ids of --input-len), 'chat' (the shipped synthetic chat "
                            "conversations), 'code-edit' (the shipped code-editing and quoting prompts) or a .jsonl "
                            "file of {\"messages\": [...] or \"prompt\": TEXT, \"output_len\": N} lines; prompts "
                            "repeat when --num-prompts exceeds the file (default: random)")
    group.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default: 64)")
    group.add_argument("--input-len", type=int, default=256, help="prompt tokens of the random dataset "
                                                                  "(default: 256)")
    group.add_argument("--output-len", type=int,
                       help=f"tokens to generate per request, EOS ignored (default: {DEFAULT_OUTPUT_LEN} for random "
                            "prompts, each conversation's own output_len for chat)")
    group.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompts and their order (default: 0)")


def describe(args: argparse.Namespace) -> str:
    """One line naming the workload, for reports."""
    if args.dataset == "random":
        return (f"{args.num_prompts} prompts x {args.input_len} random tokens -> "
                f"{args.output_len or DEFAULT_OUTPUT_LEN} tokens")
    out = f"{args.output_len} tokens" if args.output_len else "dataset lengths"
    return f"{args.num_prompts} {args.dataset} prompts -> {out}"


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.input_len < 1 or (args.output_len is not None and args.output_len < 1):
        raise ValueError("--input-len and --output-len must be >= 1")


def random_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Token ids drawn uniformly above the lowest ids (where vocabularies keep their special tokens)."""
    _check(args)
    rng = random.Random(args.dataset_seed)
    low = min(100, vocab_size // 2)
    return [BenchRequest(args.output_len or DEFAULT_OUTPUT_LEN,
                         prompt_token_ids=[rng.randrange(low, vocab_size) for _ in range(args.input_len)])
            for _ in range(args.num_prompts)]


def _conversations(args: argparse.Namespace) -> Iterator[BenchRequest]:
    """The dataset's requests (conversations or texts) in seeded shuffled passes, without end."""
    path = DATASETS.get(args.dataset, args.dataset)
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    if not items or not all(isinstance(i, dict) and "output_len" in i and (isinstance(i.get("messages"), list)
                                                                         or isinstance(i.get("prompt"), str))
                            for i in items):
        raise ValueError(f'{path} must hold one {{"messages": [...] or "prompt": TEXT, "output_len": N}} object '
                         'per line')
    rng = random.Random(args.dataset_seed)
    while True:
        rng.shuffle(items)
        for item in items:
            yield BenchRequest(args.output_len or int(item["output_len"]), messages=item.get("messages"),
                               text=item.get("prompt"))


def client_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Requests for a server: token ids below vocab_size, or conversations as they are."""
    if args.dataset == "random":
        return random_requests(args, vocab_size)
    _check(args)
    return list(itertools.islice(_conversations(args), args.num_prompts))


def engine_requests(args: argparse.Namespace, vocab_size: int, tokenizer: Tokenizer,
                    max_model_len: int) -> list[BenchRequest]:
    """Requests as token ids for an engine: conversations go through the chat template, and those that would
    outgrow max_model_len are skipped (as vLLM's dataset sampling does) rather than failing the run."""
    if args.dataset == "random":
        if args.input_len + (args.output_len or DEFAULT_OUTPUT_LEN) > max_model_len:
            raise ValueError(f"--input-len + --output-len exceeds max_model_len {max_model_len}")
        return random_requests(args, vocab_size)
    _check(args)
    requests, skipped, conversations = [], 0, _conversations(args)
    while len(requests) < args.num_prompts:
        request = next(conversations)
        if request.messages is not None:
            ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
        else:
            ids = tokenizer.encode(request.text)
        if len(ids) + request.output_len <= max_model_len:
            requests.append(dataclasses.replace(request, prompt_token_ids=ids))
        else:
            skipped += 1
            if not requests and skipped > 10 * args.num_prompts:
                raise ValueError(f"no conversation of {args.dataset} fits max_model_len {max_model_len}")
    return requests
