"""quantize_ / convert_ on any nn.Module, and the training BitLinear against transformers' AutoBitLinear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bitnetlm.quant import BitLinear
from bitnetlm.train.qat import QuantizeConfig, convert_, quantize_, set_quant_lambda


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny matrices: one thread is faster, and the CI machine is shared
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _train(model, batches, loss_fn, steps=30, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_quantize_mlp_trains_and_converts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    # keep_lm_head has no name to match here: everything is quantized, exclude the classifier by index name
    quantize_(model, QuantizeConfig(exclude=["4"]))
    assert isinstance(model[0], BitLinear) and model[0].training_mode and model[0].bias is not None
    assert isinstance(model[4], nn.Linear) and not isinstance(model[4], BitLinear)
    w_true = torch.randn(16, 4)
    x = torch.randn(512, 16)
    y = (x @ w_true).argmax(-1)
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 512, 64)]
    ce = lambda m, a, b: nn.functional.cross_entropy(m(a), b)
    losses = _train(model, batches, ce, steps=120)
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8  # it learns through the STE
    model.eval()
    with torch.no_grad():
        ref = model(x)
        convert_(model)
        assert isinstance(model[0], BitLinear) and not model[0].training_mode
        out = model(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


def test_quantize_filters_and_errors():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module("lm_head", nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no layer"):
        quantize_(nn.Sequential(nn.ReLU()))
    quantize_(model, include=["proj"])
    assert isinstance(model.proj, BitLinear) and type(model.lm_head) is nn.Linear  # head kept by default
    mha = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    quantize_(mha)
    assert isinstance(mha.linear1, BitLinear) and not isinstance(mha.self_attn.out_proj, BitLinear)
    m2 = nn.Sequential()
    m2.add_module("lm_head", nn.Linear(8, 8))
    quantize_(m2, keep_lm_head=False)
    assert isinstance(m2.lm_head, BitLinear)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def test_quantize_transformers_llama_trains_and_converts():
    model = _tiny_llama()
    quantize_(model)
    names = [n for n, m in model.named_modules() if isinstance(m, BitLinear)]
    assert len(names) == 2 * 7 and not isinstance(model.lm_head, BitLinear)
    g = torch.Generator().manual_seed(1)
    # a learnable sequence task: next token = (token + 1) mod 128
    starts = torch.randint(0, 128, (64, 1), generator=g)
    seqs = (starts + torch.arange(17)) % 128
    batches = [(seqs[i : i + 16, :-1], seqs[i : i + 16, 1:]) for i in range(0, 64, 16)]

    def lm_loss(m, a, b):
        logits = m(input_ids=a).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.reshape(-1))

    losses = _train(model, batches, lm_loss, steps=40, lr=5e-3)
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4
    model.eval()
    x = seqs[:4, :-1]
    with torch.no_grad():
        ref = model(input_ids=x).logits
        convert_(model)
        out = model(input_ids=x).logits
    assert not any(m.training_mode for m in model.modules() if isinstance(m, BitLinear))
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)


def test_gradients_match_transformers_autobitlinear():
    from transformers.integrations.bitnet import AutoBitLinear

    torch.manual_seed(0)
    ref = AutoBitLinear(48, 32, bias=False, online_quant=True).float()
    ours = BitLinear.from_linear(ref, mode="train")
    x = torch.randn(2, 5, 48, dtype=torch.float32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g_out = torch.randn(2, 5, 32)
    y_ref = ref(x1)
    y_ours = ours(x2)
    torch.testing.assert_close(y_ours, y_ref, atol=1e-5, rtol=1e-5)
    (y_ref * g_out).sum().backward()
    (y_ours * g_out).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)


def test_quant_lambda_blends_between_full_precision_and_ternary():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16, bias=False)
    model = nn.Sequential(lin)
    x = torch.randn(4, 32)
    fp = lin(x).detach()
    quantize_(model, quantize_input=False)
    set_quant_lambda(model, 0.0)
    torch.testing.assert_close(model(x), fp, atol=1e-6, rtol=1e-6)
    set_quant_lambda(model, 1.0)
    full = model(x).detach()
    set_quant_lambda(model, 0.5)
    torch.testing.assert_close(model(x), 0.5 * (fp + full), atol=1e-5, rtol=1e-5)
