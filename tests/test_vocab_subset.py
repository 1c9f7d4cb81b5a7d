"""A reduced vocabulary (config.json's `vocab_subset`, for draft models): the head scores only those ids, every
other id gets -inf, the ids outside share one embedding row; as a draft it leaves greedy speculative output
unchanged and sampled output distributed as non-speculative sampling's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_speculative import GROUNDED, REPETITIVE, _chi_square_p, _choices, _exact

import bitnetlm
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.formats.gguf import save_gguf
from bitnetlm.formats.native import save_native
from bitnetlm.formats.onnx_export import build_onnx
from bitnetlm.generate import SamplingParams, generate
from bitnetlm.models import ModelConfig, build_model
from bitnetlm.runtime.cuda.weights import from_model as cuda_weights


@pytest.fixture(scope="module")
def tiny(one_torch_thread):
    return bitnetlm.load("bitnet-tiny")


@pytest.fixture(scope="module")
def subset_copy(one_torch_thread, tmp_path_factory):
    """subset -> bitnet-tiny (None: unchanged) with its head reduced to it (the same layers; the ids outside share their mean
    embedding), saved and loaded back as any model."""
    latent, tok = bitnetlm.load("bitnet-tiny", mode="train")
    sd = latent.state_dict()
    emb = sd.pop("embed_tokens.weight")

    def make(subset: list[int] | None):
        m = build_model(latent.config.replace(vocab_subset=subset), "train")
        if subset is None:  # the model as it is, through the same path
            m.load_state_dict({**sd, "embed_tokens.weight": emb})
        else:
            rest = torch.ones(len(emb), dtype=torch.bool)
            rest[subset] = False
            other = emb[rest].mean(0, keepdim=True) if rest.any() else emb[:1] * 0
            m.load_state_dict({**sd, "embed_tokens.weight": torch.cat([emb[subset], other])})
        out = tmp_path_factory.mktemp("subset")
        bitnetlm.save(m, out, tokenizer=tok, overwrite=True)
        return bitnetlm.load(str(out))[0].eval()

    return make


def _top(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].topk(n).indices.tolist()


def test_logits_and_embedding(tiny, subset_copy):
    model, tok = tiny
    ids = tok.encode(GROUNDED)
    subset = sorted(set(range(0, 8192, 3)) | set(ids[::2]))
    sub = subset_copy(subset)
    with torch.no_grad():
        full = model(torch.tensor([ids]))
        got = sub(torch.tensor([ids]))
    out = torch.ones(8192, dtype=torch.bool)
    out[subset] = False
    assert got.shape == full.shape and torch.isinf(got[..., out]).all() and (got[..., out] < 0).all()
    assert torch.isfinite(got[..., subset]).all()
    # every id outside the subset is one input: the model cannot tell them apart
    a, b = [i for i in range(8192) if i not in set(subset)][:2]
    with torch.no_grad():
        x, y = sub(torch.tensor([ids + [a]])), sub(torch.tensor([ids + [b]]))
    assert torch.equal(x, y)
    # with the whole vocabulary as the subset (in another order) the logits are the full model's
    whole = subset_copy(list(range(8191, -1, -1)))
    with torch.no_grad():
        torch.testing.assert_close(whole(torch.tensor([ids])), subset_copy(None)(torch.tensor([ids])))


def test_config_checks_and_round_trip(tiny, subset_copy, tmp_path):
    model, tok = tiny
    base = model.config.to_hf()
    for bad, what in (([], "non-empty"), ([1, 8192], "in \\[0, 8192\\)"), ([3, 3], "without repeats")):
        with pytest.raises(ValueError, match=f"cfg.json: field 'vocab_subset' must be .*{what}"):
            ModelConfig.from_hf({**base, "vocab_subset": bad}, source="cfg.json")
    with pytest.raises(ValueError, match="field 'vocab_subset'"):
        ModelConfig.from_hf({**base, "vocab_subset": ["a"]}, source="cfg.json")
    sub = subset_copy([5, 9, 2, 700])  # (saved and loaded back)
    assert sub.config.vocab_subset == [5, 9, 2, 700] and sub.embed_tokens.weight.shape[0] == 5
    with pytest.raises(ValueError, match="GGUF has no reduced vocabulary"):
        save_gguf(sub, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="native format has no reduced vocabulary"):
        save_native(sub, tmp_path / "n")
    with pytest.raises(ValueError, match="ONNX export: a model with a reduced vocabulary"):
        build_onnx(sub)
    with pytest.raises(ValueError, match="reduced vocabulary .* runs on the CPU only"):
        cuda_weights(sub, "ternary", torch.float16, torch.device("cpu"))
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "n").exists()


def test_draft_greedy_unchanged(tiny, subset_copy):
    model, tok = tiny
    base = generate(model, tok, GROUNDED, max_tokens=40, temperature=0, ignore_eos=True)
    common = Counter(tok.encode(GROUNDED) + base.tokens)
    subset = [
        t for t, _ in common.most_common(len(common) * 2 // 3)
    ]  # some of the target's tokens are missing
    assert set(base.tokens) - set(subset)
    draft = subset_copy(subset)
    r = generate(
        model, tok, GROUNDED, max_tokens=40, temperature=0, ignore_eos=True,
        speculative=SpeculativeConfig(num_tokens=4, draft=draft),
    )  # fmt: skip
    assert r.tokens == base.tokens
    assert 0 < r.accepted_tokens < r.draft_tokens


def test_draft_sampled_distribution_unchanged(tiny, subset_copy):
    """The draft proposes from its subset only (q = 0 elsewhere); the target's top tokens lie partly outside it."""
    model, tok = tiny
    base = tok.encode(REPETITIVE)
    ids = base + generate(model, tok, base, max_tokens=6, temperature=0, ignore_eos=True).tokens + base[1:]
    depth, temp, top_k, n = 3, 1.0, 3, 1536  # (test_speculative's prompt: no near-ties at the top-k edge)
    probs = _exact(model, ids, depth, temp, top_k)
    seen = {t for seq in probs for t in seq}
    outside = sorted(seen)[::2]  # half the tokens the target can sample: never proposed
    subset = [t for t in range(8192) if t not in set(outside)]
    spec = SpeculativeConfig(num_tokens=2, draft=subset_copy(subset), adaptive=False, max_rows=256)
    counts, drafted, accepted = Counter(), 0, 0
    for b in range(n // 256):
        p = SamplingParams(max_tokens=depth, temperature=temp, top_k=top_k, seed=10_000 * b, ignore_eos=True)
        for s in _choices(model, tok, ids, p, 256, spec):
            counts[tuple(s.generated)] += 1
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
    assert drafted > n // 2 and 0 < accepted < drafted
    assert any(t in set(outside) for seq in counts for t in seq)  # tokens the draft cannot propose come out
    assert _chi_square_p(counts, probs, n) > 1e-3, (counts.most_common(8), sorted(probs.items())[:8])
