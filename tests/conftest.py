import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def oracle_dirs(tmp_path_factory):
    """variant -> (our checkpoint dir, transformers oracle dir), built once per test run by transformers."""
    from oracle import VARIANTS, make_checkpoint

    base = tmp_path_factory.mktemp("oracle")
    out = {}
    for i, v in enumerate(VARIANTS):
        ours = base / v
        out[v] = (ours, make_checkpoint(ours, v, seed=100 + i))
    return out


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny inference-mode BitNet model with random ternary weights (vocab 512)."""
    from oracle import tiny_config_kwargs

    from bitnetlm.models import ModelConfig, build_model

    cfg = ModelConfig(arch="bitnet", rope_theta=10000.0, **tiny_config_kwargs("packed-autobitlinear"))
    torch.manual_seed(0)
    m = build_model(cfg, "train")
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    from bitnetlm.quant import to_inference_

    return to_inference_(m).eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch at 1 intra-op thread for a module (restored after): tiny models gain nothing from more, and on a
    busy 2-core CI machine OpenMP spin-waiting makes each step several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def client(server):
    """The official openai client against the requesting module's `server` fixture (a started server handle)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
