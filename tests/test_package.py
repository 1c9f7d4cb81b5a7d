import json
import subprocess
import sys

from bitnetlm.cli import main


def test_import_is_cheap():
    code = (
        "import sys, bitnetlm, bitnetlm.quant, bitnetlm.models, bitnetlm.kernels;"
        "bad = [m for m in ('triton', 'transformers', 'bitnetlm.kernels.triton') if m in sys.modules];"
        "import torch; assert not torch.cuda.is_initialized(); print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_cli_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "chat", "inspect"):
        assert cmd in out


def test_inspect_hf(oracle_dirs, capsys):
    d = oracle_dirs["packed-autobitlinear"][0]
    assert main(["inspect", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "bitnet"
    assert (
        info["parameters"]
        == 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64 + 64 + 128) + 512 * 64 + 64
    )
    assert info["bits_per_ternary_weight"] == 2.0
    assert any(
        t["name"] == "model.layers.0.self_attn.q_proj.weight" and t["dtype"] == "U8" for t in info["tensors"]
    )
    assert main(["inspect", str(d)]) == 0
    assert "| model.norm.weight |" in capsys.readouterr().out


def test_inspect_parameter_count_matches_transformers(oracle_dirs):
    from oracle import oracle_model

    from bitnetlm.formats.hf import read_config

    for v in ("fp", "llama"):
        ours, ref_dir = oracle_dirs[v]
        assert read_config(ours).num_parameters() == sum(
            p.numel() for p in oracle_model(ref_dir).parameters()
        )


def test_cli_error_is_clean(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_2b4t_parameter_count_matches_formats_md():
    from bitnetlm.models import ModelConfig

    assert ModelConfig().num_parameters() == 2_412_820_480  # microsoft/bitnet-b1.58-2B-4T, FORMATS.md


def test_lazy_reexports():
    import bitnetlm

    assert (
        callable(bitnetlm.generate)
        and callable(bitnetlm.stream_generate)
        and callable(bitnetlm.batch_generate)
    )
    assert callable(bitnetlm.load) and callable(bitnetlm.save)
    assert callable(bitnetlm.quantize_) and callable(bitnetlm.convert_)


def test_configure_threads_gives_the_cores_to_the_c_kernels(oracle_dirs):
    import torch

    import bitnetlm
    from bitnetlm.kernels import configure_threads, cpu

    model, _ = bitnetlm.load(oracle_dirs["packed-autobitlinear"][0], backend="cpu")
    ref, _ = bitnetlm.load(oracle_dirs["packed-autobitlinear"][0], backend="reference")
    old = torch.get_num_threads()
    try:
        configure_threads(model, 1)
        assert cpu.get_num_threads() == 1 and torch.get_num_threads() == 1
        configure_threads(ref, 2)  # no C kernels in use: the count goes to torch
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
        cpu.set_num_threads(None)
