"""The C kernels' 1.6-bit weights (cpu-base3-v1): bit-exact against the integer oracle on every ISA path this machine
runs, the same logits as the 2-bit layout through the fused step, and the runtime option that picks the layout."""

from __future__ import annotations

import json

import pytest
import torch
from test_kernels_cpu_decode import greedy_with_runner

from bitnetlm.kernels import cpu as cpuk
from bitnetlm.kernels.cpu import _lib, ops, probe
from bitnetlm.loading import load_model
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat, pack_hf
from bitnetlm.quant.ternary import bitlinear_reference, int_matmul
from bitnetlm.runtime.args import add_runtime_arguments, runtime_from_args
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner, set_weights_layout, weights_layout

pytestmark = pytest.mark.skipif(not cpuk.available(), reason="C kernels not built")

ISAS = cpuk.supported_isas() if cpuk.available() else ["scalar"]
B3 = _lib.LAYOUT_BASE3

# (N, K, M): 2B4T projections (K = 6912 is not a multiple of the 320-element block), odd sizes, N not a multiple
# of the 4-row group, M: decode (1, 2) and the prefill tiles with their tails (3, 5, 9, 17)
SHAPES = [
    (2560, 2560, 1),
    (2560, 6912, 1),
    (640, 2560, 2),
    (37, 300, 3),
    (5, 321, 1),
    (1, 1, 1),
    (13, 959, 5),
    (66, 640, 9),
    (9, 6912, 17),
]


def _ternary(n, k, gen):
    return torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)


def test_layout_definition_roundtrip_and_c_repacks_agree():
    gen = torch.Generator().manual_seed(1)
    for n, k, _ in SHAPES:
        t = _ternary(n, k, gen)
        p = cpuk.BACKEND_BASE3.pack(t)
        assert p.shape == ((n + 3) // 4 * 4, (k + 319) // 320 * 64) and p.dtype == torch.uint8
        assert torch.equal(cpuk.BACKEND_BASE3.unpack(p, (n, k)), t)
        # the C library writes the same bytes from cpu-2bit-v2 and from transformers' 2-bit layout
        two = cpuk.BACKEND.pack(t)
        assert torch.equal(cpuk.BACKEND_BASE3.repack(two, PackingFormat.CPU_2BIT, (n, k)), p)
        assert torch.equal(cpuk.BACKEND_BASE3.repack(pack_hf(t), PackingFormat.HF_2BIT, (n, k)), p)
        assert torch.equal(cpuk.BACKEND.repack(p, PackingFormat.CPU_BASE3, (n, k)), two)  # and back


def test_digits_are_tq1_0s():
    # byte = ceil(v * 256 / 243) for the base-3 number v of the five codes, first code most significant: the
    # digits llama.cpp's TQ1_0 stores (gguf_codecs writes them with (code*256+242)//243)
    t = torch.tensor([[-1] * 64 + [0] * 64 + [1] * 64 + [-1] * 64 + [1] * 64], dtype=torch.int8)
    p = cpuk.BACKEND_BASE3.pack(t)
    v = 0 * 81 + 1 * 27 + 2 * 9 + 0 * 3 + 2
    assert int(p[0, 0]) == (v * 256 + 242) // 243


@pytest.mark.parametrize("isa", ISAS)
def test_integer_products_equal_the_oracle(isa):
    gen = torch.Generator().manual_seed(2)
    with cpuk.use_isa(isa):
        for n, k, m in SHAPES:
            if isa == "scalar" and n * k * m > 4_000_000:
                continue  # the scalar path is slow; the small shapes cover its tails
            t = _ternary(n, k, gen)
            x = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
            x[0, : min(k, 64)] = -128  # extremes: the int16 sums of the AVX2 path at their bounds
            got = ops.ternary_matmul_i32(x, cpuk.BACKEND_BASE3.pack(t), n, B3)
            assert torch.equal(got, int_matmul(x, t)), (isa, n, k, m)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_equals_the_reference_and_the_2bit_path(isa):
    gen = torch.Generator().manual_seed(3)
    with cpuk.use_isa(isa):
        for n, k, m in [(640, 2560, 1), (37, 300, 3), (13, 959, 5), (66, 640, 9)]:
            t = _ternary(n, k, gen)
            x = torch.randn(m, k, generator=gen)
            s = torch.tensor(0.37)
            y3 = cpuk.BACKEND_BASE3.linear(x, cpuk.BACKEND_BASE3.pack(t), s, n)
            assert torch.equal(y3, bitlinear_reference(x, t, s))
            assert torch.equal(y3, cpuk.BACKEND.linear(x, cpuk.BACKEND.pack(t), s, n))
            ys = cpuk.BACKEND_BASE3.linear_multi(x, [cpuk.BACKEND_BASE3.pack(t)] * 2, [s, s], [n, n])
            assert all(torch.equal(y, y3) for y in ys)


def test_custom_ops_trace_under_compile():
    gen = torch.Generator().manual_seed(8)
    t = _ternary(70, 150, gen)
    p, s = cpuk.BACKEND_BASE3.pack(t), torch.tensor([0.3])
    x = torch.randn(2, 150, generator=gen)
    torch.library.opcheck(ops.cpu_ternary_linear, (x, p, s, 70, B3))
    xq = torch.randint(-128, 128, (3, 150), dtype=torch.int8)
    torch.library.opcheck(ops.cpu_ternary_matmul_i32, (xq, p, 70, B3))

    def f(x):
        return torch.relu(cpuk.BACKEND_BASE3.linear(x, p, s, 70)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


def test_wrong_packing_is_one_line_error():
    t = _ternary(8, 640, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="cpu-base3-v1"):
        ops.ternary_linear(torch.randn(1, 640), cpuk.BACKEND.pack(t), 1.0, 8, B3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("variant", ["packed-autobitlinear", "1bitllm"])  # relu2 GQA / silu MHA
def test_fused_steps_give_the_2bit_logits(oracle_dirs, one_torch_thread, variant, isa):
    """Prefill and decode through the fused C step: the base-3 model's logits equal the 2-bit model's bit for
    bit (the same integer products), and so its greedy tokens."""
    ours, _ = oracle_dirs[variant]
    two = load_model(ours, backend="cpu", weights_layout="2bit").eval()
    three = load_model(ours, backend="cpu", weights_layout="base3").eval()
    assert weights_layout(two) == "2bit" and weights_layout(three) == "base3"
    assert {m.layout for m in three.modules() if isinstance(m, BitLinear)} == {PackingFormat.CPU_BASE3}
    rt = RuntimeConfig()
    prompt = torch.randint(3, two.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with cpuk.use_isa(isa):
        r2, r3 = CpuRunner(two, rt, 2, 7 + 12), CpuRunner(three, rt, 2, 7 + 12)
        assert r3.fused is not None
        l2, l3 = r2.prefill_many([0, 1], prompt.tolist()), r3.prefill_many([0, 1], prompt.tolist())
        assert torch.equal(l2, l3)
        tok = l2.argmax(-1).tolist()
        for i in range(12):
            l2, l3 = r2.decode([0, 1], tok, [7 + i] * 2), r3.decode([0, 1], tok, [7 + i] * 2)
            assert torch.equal(l2, l3), i
            tok = l2.argmax(-1).tolist()
        assert r3.fused.calls == 13
        # the model's own layers (no fused step) through the base-3 linears: the same logits as well
        with torch.inference_mode():
            assert torch.equal(three(prompt), two(prompt))
    assert torch.equal(greedy_with_runner(r3, prompt, 5), greedy_with_runner(r2, prompt, 5))


def test_layout_switches_back_and_saves_the_canonical_layout(oracle_dirs):
    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, backend="cpu", weights_layout="2bit").eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert set_weights_layout(model, "base3") == "base3"
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())  # still hf-2bit in a state dict
    assert set_weights_layout(model, "2bit") == "2bit"
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    ref = load_model(ours, backend="reference").eval()
    assert set_weights_layout(ref, "base3") is None  # no C-kernel weights: nothing to repack


def test_auto_keeps_2bit_in_cache_and_times_beyond_it(oracle_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("BITNET_CACHE", str(tmp_path))
    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, backend="cpu", weights_layout="auto").eval()
    assert weights_layout(model) == "2bit"  # a tiny model's weights fit the last-level cache
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = model(ids)
    # a cache smaller than the weights: both layouts are timed on the model's matrices, the faster one kept
    monkeypatch.setattr(probe, "last_level_cache_bytes", lambda: 1024)
    got = set_weights_layout(model, "auto")
    assert got in ("2bit", "base3") and weights_layout(model) == got
    with torch.inference_mode():
        assert torch.equal(model(ids), want)


def test_option_and_flag():
    assert RuntimeConfig().weights_layout == "auto"
    assert RuntimeConfig(weights_layout="base3").weights_layout == "base3"
    with pytest.raises(ValueError, match="--weights-layout 'tq3': expected one of auto, 2bit, base3"):
        RuntimeConfig(weights_layout="tq3")
    import argparse

    p = argparse.ArgumentParser()
    add_runtime_arguments(p)
    assert runtime_from_args(p.parse_args(["--weights-layout", "base3"])).weights_layout == "base3"


def test_bench_takes_the_flag(oracle_dirs, capsys):
    from bitnetlm.cli import main

    ours, _ = oracle_dirs["packed-autobitlinear"]
    argv = ["bench", "-m", str(ours), "-p", "8", "-n", "3", "-t", "1", "-r", "1", "--json", "--device", "cpu"]
    assert main([*argv, "--weights-layout", "base3"]) == 0
    assert [r["test"] for r in json.loads(capsys.readouterr().out)["results"]] == ["pp8", "tg3"]
    assert main(["bench", "--shape", "2b4t", "--weights-layout", "1bit"]) == 2
    assert "--weights-layout '1bit': expected one of auto, 2bit, base3" in capsys.readouterr().err


def test_auto_times_once_per_machine(oracle_dirs, monkeypatch, tmp_path):
    """The timed choice is kept in $BITNET_CACHE per machine (CPU, instruction set, threads): the next load reads
    it instead of timing again; an unreadable file is timed again and rewritten."""
    monkeypatch.setenv("BITNET_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "last_level_cache_bytes", lambda: 1024)
    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, backend="cpu", weights_layout="2bit").eval()
    lins = [
        m for m in model.modules() if isinstance(m, BitLinear) and getattr(m.kernel, "name", None) == "cpu"
    ]
    passes = []
    real = probe._pass
    monkeypatch.setattr(probe, "_pass", lambda *a: passes.append(1) or real(*a))
    first = probe.choose_layout(lins)
    table = json.loads((tmp_path / "cpu_weights_layout.json").read_text())
    assert list(table.values()) == [first] and passes
    passes.clear()
    assert probe.choose_layout(lins) == first and not passes  # remembered: no timing
    with cpuk.use_isa("avx2" if cpuk.get_isa() != "avx2" else "scalar"):
        probe.choose_layout(lins)  # another instruction set is another machine: timed, kept beside
    assert passes and len(json.loads((tmp_path / "cpu_weights_layout.json").read_text())) == 2
    (tmp_path / "cpu_weights_layout.json").write_text("{not json")
    passes.clear()
    assert probe.choose_layout(lins) in ("2bit", "base3") and passes
    assert len(json.loads((tmp_path / "cpu_weights_layout.json").read_text())) == 1
