"""Generation on CUDA through the CUDA-graph engine (`bitnetlm.engine_cuda.CudaEngine`).

`generate`, `stream_generate`, `batch_generate` and the CLI take this path for a model on a CUDA device (unless
`enforce_eager=True`): the fused Triton layers and one captured graph per decode step, instead of the model's
eager forward with a Python call per layer.

- The engine is built once from the model's weights and cached on the model. It is rebuilt when a parameter or
  buffer of the model has changed since (an optimizer step, `load_state_dict`), or when a call needs more rows
  or positions than it holds.
- Each prompt is prefilled into its own KV-cache row by a captured prefill (`CudaEngine.prefill`), so rows
  need no left padding; the captured step then decodes all rows at their own positions.
- Sampling runs the ops of `sampling.sample` and each row's random stream (`sampling.RowRandom`), so every
  SamplingParams feature behaves as in the eager loop: captured in a graph of its own (graph_sampler.py), or
  for requests with penalties on the host.
- Pipelining: a step's tokens are copied to pinned host memory and fed to the next graph replay before the host
  reads them, so the GPU computes step s+1 while the host detokenizes step s and checks the stop conditions.
  When the last row stops, that one speculative step is discarded. With the captured sampler, the step and the
  sampler are one graph (`GraphSampler.step_graph`), which ends by storing the tokens into one of two pinned
  buffers (`graph_sampler.HostRing`), alternately.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator

import torch

from bitnetlm.generate.sampling import sample

log = logging.getLogger(__name__)

_ATTR = "_bitnet_graph_engine"  # model.__dict__ entry: (engine or None, fingerprint, module list)
SEQ_ROUND = 1024  # positions are allocated in steps of this many (fewer rebuilds as requests grow)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (it cannot be modified in place)
        return -1


def _fingerprint(mods: list) -> tuple:
    """Identity, storage and version of every parameter and buffer of the modules `mods`, and the identity of
    every child: changes when a tensor is modified or replaced, or a submodule swapped. (Over a cached module
    list: walking the module tree on every call was a visible share of a 2B4T model's time to first token.)"""
    tensors = (t for m in mods for d in (m._parameters, m._buffers) for t in d.values() if t is not None)
    return tuple((id(t), t.data_ptr(), _version(t)) for t in tensors) + tuple(
        id(c) for m in mods for c in m._modules.values()
    )


def _weights_kind(model) -> str | None:
    """ "ternary" when every projection is a BitLinear, "dense" when none is, None otherwise (mixed)."""
    from bitnetlm.quant.bitlinear import BitLinear

    projs = []
    for blk in model.layers:
        at, mlp = blk.self_attn, blk.mlp
        projs += [at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    n = sum(isinstance(m, BitLinear) for m in projs)
    return "ternary" if n == len(projs) else "dense" if n == 0 else None


def engine_config(model, batch: int, seq: int, weights: str = "ternary"):
    """The EngineConfig for `model`: its activation dtype, `model.kv_cache_dtype` and, from `load(...,
    head_dtype="int8")` on CUDA, `model.head_dtype` (the int8 LM head; any other value keeps the float head)."""
    from bitnetlm.engine_cuda import EngineConfig

    return EngineConfig(
        max_batch=batch,
        max_seq_len=seq,
        dtype=model.embed_tokens.weight.dtype,
        weights=weights,
        head="int8" if getattr(model, "head_dtype", None) == "int8" else "fp",
        kv_dtype=getattr(model, "kv_cache_dtype", None),
    )


def build_engine(model, batch: int, seq: int, device: torch.device):
    """A new CudaEngine over `model` with `batch` rows of `seq` positions, or None (logged) when the engine
    cannot run this model: no Triton, not a bitnetlm CausalLM, mixed projections, an unsupported feature."""
    try:
        import triton  # noqa: F401  (the engine's kernels)

        from bitnetlm.engine_cuda import CudaEngine

        if not all(hasattr(model, a) for a in ("layers", "embed_tokens", "norm", "inv_freq", "config")):
            raise TypeError(f"{type(model).__name__} is not a bitnetlm CausalLM")
        kind = _weights_kind(model)
        if kind is None:
            raise TypeError("the projections mix BitLinear and full-precision layers")
        return CudaEngine.from_model(model, engine_config(model, batch, seq, kind), device=device, share=True)
    except (ImportError, TypeError, ValueError) as e:
        log.info("the CUDA-graph engine cannot run this model (%s); using the eager forward", e)
        return None


def graph_engine(model, batch: int, seq: int):
    """The model's CudaEngine with room for `batch` rows of `seq` positions (built or grown as needed), or None
    when the engine cannot run this model: generation then takes the eager path."""
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    eng, fp0, mods = model.__dict__.get(_ATTR, (None, None, None))
    opts = (getattr(model, "kv_cache_dtype", None), getattr(model, "head_dtype", None))  # engine options
    fp = (_fingerprint(mods), opts) if mods is not None else None
    if fp is not None and fp0 == fp:
        if eng is None:
            return None  # known unsupported, weights unchanged
        if eng.ecfg.max_batch >= batch and eng.ecfg.max_seq_len >= seq:
            return eng
        batch, seq = max(batch, eng.ecfg.max_batch), max(seq, eng.ecfg.max_seq_len)
    model.__dict__.pop(_ATTR, None)
    del eng  # free the old engine's weights and KV cache before allocating the new one
    mods = list(model.modules())
    seq = -(-seq // SEQ_ROUND) * SEQ_ROUND
    new = build_engine(model, batch, seq, device)
    # fingerprint after the build: it re-points the weights
    model.__dict__[_ATTR] = (new, (_fingerprint(mods), opts), mods)
    return new


# Rows without penalties sample inside a captured graph of their own (graph_sampler.py); False (or the environment's
# BITNETLM_HOST_SAMPLER=1, for benchmarks' A/B of a server): always the host sampler, as before stop 51.
GRAPH_SAMPLER = os.environ.get("BITNETLM_HOST_SAMPLER", "0") != "1"


def graph_sampler_on() -> bool:
    """Whether generate's and the server's CUDA-graph rows sample in a captured graph (GRAPH_SAMPLER)."""
    return GRAPH_SAMPLER


@torch.no_grad()
def run_graph(eng, rows, t0: float) -> Iterator:
    """The decode loop of `generate._engine` over the engine: yields the same GenerationChunk stream."""
    dev = eng.device
    b = len(rows)
    lens = [len(r.ids) for r in rows]
    # captured before the prefill (its warm-up writes KV slots 0-2 of every row); finished rows keep stepping
    # until the last one ends, so no row passes the longest prompt + the most new tokens
    st = eng.logits_state(b, max_keys=max(lens) + max(r.max_new for r in rows))
    top_n = max(r.params.top_logprobs for r in rows)
    gs = None
    if graph_sampler_on() and not any(r.params.needs_penalties for r in rows):
        from bitnetlm.generate.graph_sampler import graph_sampler

        # captured before the prefill too; loaded with the rows' parameters and their draws
        draws = [r.max_new for r in rows]
        gs = graph_sampler(eng, st, [r.params for r in rows], [r.generator for r in rows], draws, top_n)
        gs.step_graph(st)
    logits = torch.stack([eng.prefill(r.ids, i) for i, r in enumerate(rows)])  # [B, V], a graph replay each
    st.pos.copy_(torch.tensor(lens, dtype=torch.int32))
    torch.cuda.synchronize(dev)
    prompt_tps = sum(lens) / max(time.perf_counter() - t0, 1e-9)
    if gs is None:
        yield from _host_sampled(st, rows, logits, top_n, t0, prompt_tps)
    else:
        st.logits.copy_(logits)  # the prefill's logits: the first step's
        yield from _graph_sampled(st, gs, rows, top_n, t0, prompt_tps)


def _graph_sampled(st, gs, rows, top_n, t0, prompt_tps) -> Iterator:
    """The first tokens from the prefill's logits by the sampler's own replay; then each replay of the step +
    sampler graph (gs.step_graph) computes the next step's logits and tokens, into the other slot of the
    sampler's pinned HostRing, while the host handles this step's. Every row samples and steps, the finished
    ones unseen."""
    from bitnetlm.generate.generate import _emit
    from bitnetlm.generate.sampling import SampleOutput

    both, ring = gs.step_graph(st), gs.host
    done = (torch.cuda.Event(), torch.cuda.Event())
    active = [r for r in rows if r.finish_reason is None]
    ring.reset()
    gs.run()
    ring.export(gs)
    done[0].record()
    for s in itertools.count():
        both.replay()  # the next step, while the host handles this one's tokens
        done[(s + 1) % 2].record()
        done[s % 2].synchronize()
        k = ring.slot(s)
        ai = [r.index for r in active]
        toks, lps = ring.tok[k].tolist(), ring.lp[k].tolist()
        top_i, top_v = (ring.top_i[k][ai], ring.top_v[k][ai]) if top_n else (None, None)
        out = SampleOutput(ring.tok[k], ring.lp[k], top_i, top_v)
        yield from _emit(
            active, out, [toks[i] for i in ai], [lps[i] for i in ai], time.perf_counter(), t0, prompt_tps
        )
        active = [r for r in active if r.finish_reason is None]
        if not active:
            return


def _host_sampled(st, rows, logits, top_n, t0, prompt_tps) -> Iterator:
    """Each step: `sampling.sample` of the active rows (penalties need their outputs on the host), its tokens
    into the step's input, then the step's replay, queued before the host reads the tokens."""
    from bitnetlm.generate.generate import _emit

    dev = logits.device
    b = len(rows)
    active = [r for r in rows if r.finish_reason is None]
    idx = None if len(active) == b else torch.tensor([r.index for r in active], device=dev)
    tok_h = torch.empty((b,), dtype=torch.long, pin_memory=True)
    lp_h = torch.empty((b,), dtype=torch.float32, pin_memory=True)
    ready = torch.cuda.Event()
    while True:
        out = sample(
            logits if idx is None else logits[idx],
            [r.params for r in active],
            [r.generator for r in active],
            prompt_tokens=[r.ids for r in active],
            output_tokens=[r.out for r in active],
            num_top_logprobs=top_n,
        )
        n = len(active)
        tok_h[:n].copy_(out.tokens, non_blocking=True)
        lp_h[:n].copy_(out.logprobs, non_blocking=True)
        ready.record()
        if idx is None:
            st.tok.copy_(out.tokens[:, None])
        else:  # finished rows keep decoding their last token, unseen (their cache rows are their own)
            st.tok.index_copy_(0, idx, out.tokens[:, None])
        st.graph.replay()  # the next step's logits, while the host handles this step's tokens
        ready.synchronize()
        yield from _emit(
            active, out, tok_h[:n].tolist(), lp_h[:n].tolist(), time.perf_counter(), t0, prompt_tps
        )
        still = [r for r in active if r.finish_reason is None]
        if not still:
            return
        if len(still) != n:
            active = still
            idx = torch.tensor([r.index for r in active], device=dev)
        logits = st.logits
