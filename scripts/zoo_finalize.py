#!/usr/bin/env python3
"""Turn a training run's output (state shards + results.json from scripts/train_*.py) into a zoo model.

  tiny     OUT_DIR -> bitnetlm/zoo/bundled/bitnet-tiny/ (HF dir via bitnetlm.save, tokenizer, README.md card)
  smollm2  OUT_DIR -> bitnetlm/zoo/parts/smollm2-135m-1.58/ (parts: state shards, config, README.md; the
           embedding's source and the tokenizer are placed there by scripts/zoo_smollm2_parts.py) and a check
           that it assembles

Both update bitnetlm/zoo/registry.json with sizes, parameter counts and the eval numbers of the card.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = ROOT / "bitnetlm" / "zoo" / "registry.json"


def _load_state(paths: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for p in sorted(paths):
        sd.update(load_file(p))
    return sd


def _update_registry(name: str, **fields) -> None:
    reg = json.loads(REGISTRY.read_text())
    for e in reg["models"]:
        if e["name"] == name:
            e.update(fields)
    tmp = REGISTRY.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(reg, indent=1) + "\n")
    os.replace(tmp, REGISTRY)


def _dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def _ternary_params(cfg) -> int:
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return L * (2 * h * q + 2 * h * kv + 3 * h * i)


def tiny(out_dir: str, card_template: str) -> None:
    import bitnetlm
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.text.tokenizer import Tokenizer

    res = json.loads(Path(out_dir, "results.json").read_text())
    cfg = ModelConfig.from_hf(json.loads(Path(out_dir, "bitnet-tiny-config.json").read_text()))
    model = build_model(cfg, mode="infer")
    sd = _load_state(glob.glob(os.path.join(out_dir, "bitnet-tiny-state-*.safetensors")))
    sd = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    dest = ROOT / "bitnetlm" / "zoo" / "bundled" / "bitnet-tiny"
    tok = Tokenizer.from_dir(dest)
    stage = dest.with_name(".bitnet-tiny-stage")
    shutil.rmtree(stage, ignore_errors=True)
    bitnetlm.save(model, stage, tokenizer=None, dtype=torch.bfloat16)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        os.replace(stage / f, dest / f)
    shutil.rmtree(stage, ignore_errors=True)
    del tok
    runs = res["runs"]
    tern = runs["bitnet-tiny"]["heldout_ppl"]
    fp_name = min(
        (n for n in runs if runs[n]["quant"] == "none"), key=lambda n: runs[n]["heldout_ppl"]["all"]
    )
    fp = runs[fp_name]["heldout_ppl"]
    ev = {
        "heldout_ppl_austen": tern["austen_all"],
        "heldout_ppl_tempest": tern["shakespeare_the-tempest"],
        "fp_twin_heldout_ppl_austen": fp["austen_all"],
        "fp_twin_heldout_ppl_tempest": fp["shakespeare_the-tempest"],
    }
    card = Path(card_template).read_text()
    table = [
        "| run | quant | lr | Austen held-out ppl (6 x 4096 tok) | The Tempest ppl | all held-out |",
        "|---|---|---|---|---|---|",
    ]
    for n, r in runs.items():
        h = r["heldout_ppl"]
        table.append(
            f"| {n} | {r['quant']} | {r['lr']} | {h['austen_all']} | {h['shakespeare_the-tempest']} | {h['all']} |"
        )
    samples = "\n".join(f"- `{p.strip()!r}` -> `{s!r}`" for p, s in runs["bitnet-tiny"]["samples"].items())
    card = card.format(
        eval_table="\n".join(table),
        steps=res["steps"],
        tokens=f"{res['tokens_seen'] / 1e6:.1f}M",
        train_seconds=res["train_seconds"],
        device=res["device"],
        params=f"{cfg.num_parameters() / 1e6:.1f}M",
        ternary=f"{_ternary_params(cfg) / 1e6:.1f}M",
        ratio=f"{tern['all'] / fp['all']:.3f}",
        fp_name=fp_name,
        samples=samples,
        size=f"{_dir_size(dest) / 1e6:.1f} MB",
    )
    (dest / "README.md").write_text(card)
    _update_registry(
        "bitnet-tiny",
        params=cfg.num_parameters(),
        ternary_params=_ternary_params(cfg),
        bits_per_weight=2.0,
        size_bytes=_dir_size(dest),
        eval=ev,
    )
    print(json.dumps(ev), _dir_size(dest))


def smollm2(out_dir: str, card_template: str) -> None:
    from bitnetlm.models import ModelConfig

    res = json.loads(Path(out_dir, "smollm2-results.json").read_text())
    dest = ROOT / "bitnetlm" / "zoo" / "parts" / "smollm2-135m-1.58"
    dest.mkdir(parents=True, exist_ok=True)
    for p in glob.glob(str(dest / "state-*.safetensors")):
        os.remove(p)
    for p in sorted(glob.glob(os.path.join(out_dir, "smollm2-135m-1.58-state-*.safetensors"))):
        shutil.copy(p, dest / os.path.basename(p).replace("smollm2-135m-1.58-", ""))
    cfg_d = json.loads(Path(out_dir, "smollm2-config.json").read_text())
    (dest / "config.json").write_text(json.dumps(cfg_d, indent=2) + "\n")
    cfg = ModelConfig.from_hf(cfg_d)
    chat = "\n".join(
        f"| {c['q']} | {c['teacher']!r} | {c['student']!r} |".replace("\n", " ") for c in res["chat"]
    )
    th, sh = res.get("teacher_heldout_ctx1024", {}), res.get("student_heldout_ctx1024", {})
    card = (
        Path(card_template)
        .read_text()
        .format(
            teacher_ppl=res["teacher_austen_last4096_ppl"],
            student_ppl=res["student_austen_last4096_ppl"],
            ratio=res["ratio"],
            teacher_austen=th.get("austen_all", "-"),
            student_austen=sh.get("austen_all", "-"),
            teacher_tempest=th.get("shakespeare_the-tempest", "-"),
            student_tempest=sh.get("shakespeare_the-tempest", "-"),
            steps=res["steps"],
            tokens=f"{res['tokens_seen'] / 1e6:.1f}M",
            train_seconds=res["train_seconds_total"],
            device=res["device"],
            chat_table=chat,
        )
    )
    (dest / "README.md").write_text(card)
    from bitnetlm.zoo.assemble import assemble

    out = assemble("smollm2-135m-1.58", dest, Path(os.environ.get("TMPDIR", "/tmp")) / "zoo-smollm2-check")
    _update_registry(
        "smollm2-135m-1.58",
        params=cfg.num_parameters(),
        ternary_params=_ternary_params(cfg),
        bits_per_weight=2.0,
        size_bytes=_dir_size(out),
        eval={
            "austen_last4096_ppl": res["student_austen_last4096_ppl"],
            "teacher_austen_last4096_ppl": res["teacher_austen_last4096_ppl"],
        },
    )
    print("assembled", out, _dir_size(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["tiny", "smollm2"])
    ap.add_argument("out_dir", help="the training run's output directory")
    ap.add_argument("--card", help="model card template (default examples/zoo_<which>_card.md)")
    a = ap.parse_args(argv)
    card = a.card or str(ROOT / "examples" / f"zoo_{a.which}_card.md")
    (tiny if a.which == "tiny" else smollm2)(a.out_dir, card)
    return 0


if __name__ == "__main__":
    sys.exit(main())
