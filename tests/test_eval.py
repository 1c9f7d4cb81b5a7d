"""bitnet eval: sliding-window perplexity against transformers' own loss, MMLU-format accuracy."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from assets import asset
from train_utils import ROOT, TINY_BITNET

from bitnetlm.train.eval import load_mc_questions, multiple_choice, perplexity


@pytest.fixture(scope="module")
def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float().eval()


def _hf_strided_nll(model, ids: torch.Tensor, ctx: int, stride: int) -> tuple[float, int]:
    """The transformers documentation's strided-perplexity loop, using the model's own loss (labels=-100)."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    n = ids.numel()
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        trg_len = end - prev_end
        x = ids[None, begin:end]
        labels = x.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(x, labels=labels).loss
        k = (labels[:, 1:] != -100).sum().item()  # transformers shifts labels left by one
        nll_sum += loss.item() * k
        n_tokens += k
        prev_end = end
        if end == n:
            break
    return nll_sum / n_tokens, n_tokens


@pytest.mark.parametrize("ctx,stride", [(64, 64), (16, 8), (16, 5), (16, 16)])
def test_perplexity_matches_transformers_strided_loss(hf_llama, ctx, stride):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (50,), generator=g)
    ours = perplexity(hf_llama, ids, ctx=ctx, stride=stride, batch_size=3)
    want, n = _hf_strided_nll(hf_llama, ids, min(ctx, 50), stride)
    assert ours["tokens"] == n
    if stride < min(ctx, 50):
        assert n == 49  # overlapping windows: every token after the first is scored exactly once
    assert math.isclose(ours["nll"], want, rel_tol=1e-5)
    assert math.isclose(ours["perplexity"], math.exp(want), rel_tol=1e-5)


class _CharTok:
    """A tiny character tokenizer so that the test needs no downloaded vocabulary."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 97 for c in text]


def test_multiple_choice_batched_equals_one_by_one(hf_llama):
    qs = load_mc_questions(asset("mmlu") / "mmlu.jsonl", subjects=["astronomy"], limit=12)
    assert len(qs) == 12 and all(q["topic"] == "astronomy" for q in qs)
    tok = _CharTok()
    res = multiple_choice(hf_llama, tok, qs, shots=1, batch_size=5, ctx=64)
    # oracle: one prompt at a time, no padding, argmax over the letter tokens
    from bitnetlm.train.eval import format_question

    correct = 0
    letters = [tok.encode(" " + L)[-1] for L in "ABCD"]
    for q in qs:
        ex = [e for e in qs if e is not q and e["topic"] == q["topic"]][:1]
        ids = tok.encode("".join(format_question(e, True) for e in ex) + format_question(q))[-64:]
        with torch.no_grad():
            logits = hf_llama(torch.tensor([ids])).logits[0, -1]
        correct += int(logits[letters].argmax()) == q["answer"]
    assert res["correct"] == correct and res["n"] == 12 and res["accuracy"] == correct / 12


def test_mmlu_file_and_bad_rows(tmp_path):
    qs = load_mc_questions(asset("mmlu") / "mmlu.jsonl")
    assert len(qs) == 14042 and len({q["topic"] for q in qs}) == 57
    hf_rows = [{"question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "math"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(
            {"question": "question", "answer_a": "answer_a", "correct_answer": "answer"}
        )  # CSV header: skipped
        + "\n"
        + json.dumps(hf_rows[0])
        + "\n"
        + json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        load_mc_questions(bad)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(hf_rows[0]) + "\n")
    assert load_mc_questions(good)[0]["answer"] == 1


def test_cli_eval_json_on_a_saved_model(tmp_path):
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.train.data import train_tokenizer
    from bitnetlm.train.export import export_model
    from bitnetlm.train.loop import init_weights

    text = (asset("austen") / "persuasion.txt").read_text()
    (tmp_path / "train.txt").write_text(text[:20000])
    (tmp_path / "held.txt").write_text(text[-3000:])
    tok = train_tokenizer([tmp_path / "train.txt"], 260, tmp_path / "tok")
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(**TINY_BITNET, vocab_size=260, bos_token_id=None, eos_token_id=None), "train"
    )
    init_weights(model)
    out = export_model(model, tmp_path / "model", tokenizer_dir=tok)
    p = subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", "eval", "-m", str(out), "--text", str(tmp_path / "held.txt"),
         "-c", "32", "--stride", "16", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    # oracle: the training-mode model scoring the same tokens through the same windows
    from tokenizers import Tokenizer

    ids = torch.tensor(
        Tokenizer.from_file(str(tok / "tokenizer.json")).encode((tmp_path / "held.txt").read_text()).ids
    )
    want = perplexity(model, ids, ctx=32, stride=16)
    assert res["tokens"] == want["tokens"]
    assert math.isclose(res["perplexity"], want["perplexity"], rel_tol=1e-4)
    assert res["perplexity"] == pytest.approx(math.exp(res["nll"]))
