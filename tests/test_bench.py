"""`bitnet bench` (CPU parts): random real-shape models, the test loop, table and --json output."""

from __future__ import annotations

import json

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
