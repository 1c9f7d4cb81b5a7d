"""`bitnet bench`: random real-shape models, the test loop, table and --json output; its CUDA half's options
and, on a GPU, its engines built from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from bitnetlm import bench
from bitnetlm.cli import main
from bitnetlm.kernels import cpu
from bitnetlm.quant.bitlinear import BitLinear

TINY = dict(
    arch="bitnet",
    vocab_size=300,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_random_packed_is_valid_ternary():
    gen = torch.Generator().manual_seed(0)
    p = bench.random_packed(64, 256, cpu.BACKEND, gen)
    t = cpu.BACKEND.unpack(p, (64, 256))
    counts = torch.bincount((t.flatten() + 1).long(), minlength=3)
    assert counts.sum() == 64 * 256 and (counts > 64 * 256 // 4).all()  # roughly uniform over -1, 0, 1
    p2 = bench.random_packed(5, 130, cpu.BACKEND, gen)  # K not a multiple of the block: padding stays 0
    assert torch.equal(cpu.BACKEND.pack(cpu.BACKEND.unpack(p2, (5, 130))), p2)


def test_random_model_runs_and_bench_rows():
    model = bench.random_model(TINY, head_dtype="int8")
    assert all(m.packed.device.type == "cpu" for m in model.modules() if isinstance(m, BitLinear))
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()
    rows = bench.bench(model, n_prompt=(8,), n_gen=(4,), threads=[1, 2], repetitions=2, label="tiny")
    assert [(r["threads"], r["test"]) for r in rows] == [(1, "pp8"), (1, "tg4"), (2, "pp8"), (2, "tg4")]
    assert all(r["tokens_per_s"] > 0 and len(r["runs"]) == 2 and r["head"] == "int8" for r in rows)
    table = bench.markdown(rows)
    assert table.splitlines()[0].startswith("| model | size | params | backend")
    assert "| tg4 |" in table and "cpu-" in table


def test_depth_runs_each_test_after_a_cached_context(capsys):
    """-d (llama-bench's --n-depth): each test again after D tokens already in the cache, named as llama-bench
    names it; the cache really holds the context (the prefill's queries see it)."""
    model = bench.random_model(TINY)
    rows = bench.bench(model, n_prompt=(8,), n_gen=(4,), threads=[1], repetitions=1, depths=(0, 5))
    assert [(r["test"], r["depth"]) for r in rows] == [
        ("pp8", 0),
        ("pp8 @ d5", 5),
        ("tg4", 0),
        ("tg4 @ d5", 5),
    ]
    gen = torch.Generator().manual_seed(0)
    runner = bench._runner(model, 8, 5, 300, gen)
    assert runner.cache.valid[0].tolist() == [True] * 5 + [False] * 8
    assert main(["bench", "--shape", "2b4t", "-d", "0,-1"]) == 2
    assert "-d/--n-depth takes counts >= 0, found [0, -1]" in capsys.readouterr().err


def test_cli_json_on_a_checkpoint(oracle_dirs, capsys):
    ours, _ = oracle_dirs["packed-autobitlinear"]
    rc = main(
        [
            "bench",
            "-m",
            str(ours),
            "-p",
            "8",
            "-n",
            "3",
            "-t",
            "1",
            "-r",
            "1",
            "--json",
            "--head-dtype",
            "bf16",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    tests = [r["test"] for r in out["results"]]
    assert tests == ["pp8", "tg3"] and out["machine"]
    assert out["results"][0]["head"] == "bf16"


def test_cli_rejects_model_and_shape_together(capsys):
    assert main(["bench", "-m", "x", "--shape", "2b4t"]) == 2
    assert "exactly one" in capsys.readouterr().err


def test_cpu_model_name_names_the_family(tmp_path):
    """A VM's model name can be only "AMD EPYC": the family and model (and AMD's generation) tell Zen 3 from 5."""
    from bitnetlm.bench import cpu_model_name

    block = "processor\t: {p}\nvendor_id\t: {v}\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: {n}\n\n"
    zen5 = tmp_path / "zen5"
    zen5.write_text(
        block.format(p=0, v="AuthenticAMD", f=26, m=2, n="AMD EPYC")
        + block.format(p=1, v="AuthenticAMD", f=25, m=1, n="other")
    )
    assert cpu_model_name(str(zen5)) == "AMD EPYC (family 26 model 2, Zen 5)"
    intel = tmp_path / "intel"
    intel.write_text(block.format(p=0, v="GenuineIntel", f=6, m=143, n="Intel(R) Xeon(R) Platinum 8480+"))
    assert cpu_model_name(str(intel)) == "Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143)"
    assert cpu_model_name(str(tmp_path / "missing"))  # platform's answer, never empty


def test_cuda_bench_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--shape", "2b4t", "--device", "cuda"]) == 2
    assert "--device 'cuda' is not available here (available: cpu)" in capsys.readouterr().err
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: True
    )  # the options are checked before the GPU is used
    assert main(["bench", "--shape", "2b4t", "--device", "cuda", "--kv-cache-dtype", "auto,fp4"]) == 2
    assert "--kv-cache-dtype 'fp4': expected auto, bf16 or fp8" in capsys.readouterr().err


@pytest.mark.parametrize("opt", [["-b", "1,8"], ["--kv-cache-dtype", "fp8"]])
def test_batch_and_kv_cache_options_are_cuda_only(opt, capsys):
    assert main(["bench", "--shape", "2b4t", "--device", "cpu", *opt]) == 2
    assert "apply to --device cuda only" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_bench_of_a_checkpoint_times_its_own_weights(oracle_dirs, capsys):
    """`bitnet bench -m DIR --device cuda` builds its engines from that checkpoint (not a random shape): every
    row's resident weights are those of an engine built from the loaded model, ternary and bf16 baseline."""
    from bitnetlm.loading import load_model
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    ours, _ = oracle_dirs["packed-autobitlinear"]
    argv = ["bench", "-m", str(ours), "--device", "cuda", "-p", "16", "-n", "8", "-b", "1,2", "-r", "1"]
    assert main([*argv, "--json", "--head-dtype", "int8", "--kv-cache-dtype", "auto,fp8", "-d", "0,4"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert str(ours) in res["config"]["weights"] and res["config"]["max_seq_len"] == 4 + 16 + 8 + 1
    kinds = [(r["weights"], r["head"], r["kv"], r["batch"], r["depth"]) for r in res["results"]]
    assert kinds == [
        (w, h, kv, b, d)
        for w, h, kv in (("ternary", "int8", "auto"), ("ternary", "int8", "fp8"), ("dense", "fp", "auto"))
        for b in (1, 2)
        for d in (0, 4)
    ]
    model = load_model(ours, device="cuda").eval()
    for weights, head in (("ternary", "int8"), ("dense", "fp")):
        eng = CudaEngine.from_model(
            model, EngineConfig(max_batch=2, max_seq_len=25, weights=weights, head=head)
        )
        gib = sum(eng.weight_bytes().values()) / 2**30
        for r in (r for r in res["results"] if r["weights"] == weights):
            assert r["weight_gib"] == pytest.approx(gib)
            assert r["weight_bytes_per_step"] == eng.bytes_per_step(r["batch"])
            assert r["decode_tok_s"] == pytest.approx(r["batch"] / r["decode_ms_per_step"] * 1e3)
    assert len(res["ratios"]) == 8 and all(x["decode_speedup"] > 0 for x in res["ratios"])
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 0  # the markdown table names the checkpoint
    assert f"the weights of {ours}" in capsys.readouterr().out
