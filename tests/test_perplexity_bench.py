"""`folio bench perplexity`: windows of the text scored through the engine equal Transformers' log-likelihood."""

from __future__ import annotations

import json
import math

import torch

from conftest import hf_logprobs
from folio.bench.perplexity import DEFAULT_TEXT, windows
from folio.cli import main
from folio.tokenizer import Tokenizer


def test_windows_drop_a_last_token_that_scores_nothing():
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert DEFAULT_TEXT.stat().st_size > 10_000  # the shipped text


def test_perplexity_is_transformers_likelihood_of_each_window(tiny_model_factory, tmp_path, capsys):
    folder = tiny_model_factory("llama", True)
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 6, encoding="utf-8")
    out = tmp_path / "ppl.json"
    assert main(["bench", "perplexity", "--model", folder, "--dtype", "float32", "--text", str(text),
                 "--window", "40", "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ids = Tokenizer.from_dir(folder).encode(text.read_text(encoding="utf-8"), add_special_tokens=False)
    nll = 0.0
    for chunk in windows(ids, 40):
        logprobs = hf_logprobs(folder, chunk)
        nll -= float(logprobs[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].sum())
    scored = len(ids) - len(windows(ids, 40))
    assert result["scored_tokens"] == scored and result["window"] == 40 and result["quantization"] == "none"
    assert math.isclose(result["perplexity"], math.exp(nll / scored), rel_tol=1e-4)
    assert f"perplexity {result['perplexity']:.4f}" in capsys.readouterr().out
