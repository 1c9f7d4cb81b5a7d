"""The CUDA path's one-time work (CUDA context, first kernels, Triton's compiler key), started in threads while
a loader reads the weights (`bitnetlm.load` on a CUDA device), so that the first token comes sooner."""

from __future__ import annotations

import threading

import torch

_warm_threads: list[threading.Thread] = []
_warmed: set[tuple] = set()


def _warm_up_torch(dev: torch.device, dtype: torch.dtype | None, config) -> None:
    """The CUDA context, then the torch kernels a decoder's first GPU forward launches (CUDA loads each kernel
    at its first launch, tens of ms apiece for the embedding gather, cuBLAS and flash attention): run once on
    small tensors of the model's dtype and row width. Touches no model state."""
    torch.empty(1, device=dev)
    if dtype is None or config is None:
        return
    import torch.nn.functional as F

    c = config
    h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = F.embedding(
        torch.zeros(16, dtype=torch.long, device=dev), torch.zeros(64, h, dtype=dtype, device=dev)
    )
    F.linear(x[:1], torch.zeros(256, h, dtype=dtype, device=dev))  # cuBLAS handle and its first GEMM
    q = torch.zeros(1, nh, 128, hd, dtype=dtype, device=dev)  # the engine's first prefill length bucket
    kv = torch.zeros(1, nkv, 128, hd, dtype=dtype, device=dev)
    from bitnetlm.runtime.cuda.engine import prefill_attention

    prefill_attention(q, kv, kv, gqa=nh != nkv)
    logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
    vals, idx = logits.view(1, 64, -1).max(dim=-1)
    idx.gather(1, vals.argmax(dim=-1, keepdim=True))
    torch.cuda.synchronize(dev)


def start(device: torch.device, name: str, dtype: torch.dtype | None = None, config=None) -> None:
    """Start the GPU path's one-time work in daemon threads, so that it overlaps reading the weights: the CUDA
    context and first torch kernels (`dtype`, shapes from the ModelConfig `config`), and the backend's
    `warm_up()` (for Triton: its import and compiler keys). `join` waits for them. Nothing starts for a CPU
    device, another backend or a second call. Best effort: a failure here is silent (the same step then runs,
    and fails, where it always did)."""
    dev = torch.device(device)
    if dev.type != "cuda" or name != "triton":
        return
    if dev.index is None and torch.cuda.is_initialized():  # the caller's current device, not the thread's
        dev = torch.device("cuda", torch.cuda.current_device())
    shapes = None if config is None else (config.hidden_size, config.head_dim, config.vocab_size)
    key = (str(dev), dtype, shapes)
    if key in _warmed:
        return
    _warmed.add(key)

    def backend_work():
        from bitnetlm.kernels import get_backend

        get_backend(name).warm_up()

    threads = []
    for fn in (backend_work, lambda: _warm_up_torch(dev, dtype, config)):

        def run(fn=fn):
            try:
                fn()
            except Exception:  # noqa: S110 - the first real use reports (or redoes) whatever failed here
                pass

        threads.append(threading.Thread(target=run, name="bitnetlm-warm-up", daemon=True))
        threads[-1].start()
    _warm_threads.extend(threads)


def join() -> None:
    """Wait for the work `start` began (before the model's first use)."""
    while _warm_threads:
        _warm_threads.pop().join()
