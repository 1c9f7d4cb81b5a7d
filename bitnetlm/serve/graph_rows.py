"""The serving engine's KV-cache rows on CUDA: the CUDA-graph engine (`bitnetlm.engine_cuda.CudaEngine`) in place
of the model's eager forward and cache.

The serving engine (engine.py) keeps its scheduling: rows, chunked prefill, prompt sharing between the choices
of one request, and one decode forward over rows [0, hi). Only the three tensor operations change:
- prefill: a chunk of one row's prompt, at the position where its cached part ends: the first chunk through
  a captured prefill (`CudaEngine.prefill`), later ones through `CudaEngine.forward` with row0 / start;
- copy_prompt: a prefilled prompt's keys and values into a sibling's row;
- decode: one replay of a captured step over the smallest captured batch that covers rows [0, hi), built for
  the shortest key range that holds their contexts (`attention.key_range`: fewer attention splits while short);
- sample: the decoded rows' next tokens through a captured sampler (`graph_sampler.ContinuousSampler`: one
  replay over the step's logits, each row's draws loaded once, when it starts decoding) in place of the host
  sampler's some 30 launches a step; rows with penalties stay on the host sampler (engine.py).

Every batch size, and each short key range of it, is captured when the server starts, before any row holds a
sequence: a capture's eager warm-up runs write KV slots 0-2 of each row. So is the prefill of the shortest
prompts: a GEMM shape the tuner meets for the first time on a GPU costs seconds of timing, better spent before
/health says ready. For the same reason the scheduler (engine.py) splits only the first prompt of a step, at
`prefill_chunk` boundaries: chunks that continue a prompt (the eager `forward` with a start) then come in few
shapes.

Rows that are free or still prefilling decode a padding token at their next free slot, which their own prefill
or next token overwrites, as in the eager engine.

The engine is the server's own (not the one `generate` caches on the model), so a `generate` call in another
thread never shares its KV cache.
"""

from __future__ import annotations

import torch

from bitnetlm.engine_cuda import PREFILL_ALIGN


class GraphRows:
    def __init__(self, eng, max_batch: int):
        self.eng = eng
        self.device = eng.device
        from bitnetlm.kernels.triton.attention import key_ranges  # (Triton: only once a CUDA engine exists)

        self.sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self.logits = None  # the last decode step's logits [size, V] (all of its captured batch)
        self.sampler = None  # graph_sampler.ContinuousSampler over max_batch rows, made on first use
        for b in self.sizes:  # capture now, while no row is in use: every size, and its short-context steps
            for keys in [0, *key_ranges()]:
                eng.logits_state(b, max_keys=keys)
        eng.prefill_state(PREFILL_ALIGN)  # and the shortest prompts' prefill (tuning its GEMMs on a new GPU)

    @classmethod
    def create(cls, model, max_batch: int, max_len: int) -> GraphRows | None:
        """The rows over a new engine for `model`, or None when the engine cannot run it (eager serving)."""
        from bitnetlm.generate.graph import build_engine

        eng = build_engine(model, max_batch, max_len, next(model.parameters()).device)
        return None if eng is None else cls(eng, max_batch)

    def prefill(self, row: int, ids: list[int], start: int) -> torch.Tensor:
        """Prompt tokens `ids` at positions start.. into `row` -> float32 logits [V] after the last one."""
        if start == 0:  # a captured prefill (one graph per padded length)
            return self.eng.prefill(ids, row)
        tok = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.full((1,), start, dtype=torch.int32, device=self.device)
        return self.eng.forward(tok, pos, row0=row, start=start)[0]

    def copy_prompt(self, src: int, dst: int, n: int) -> None:
        for c in self.eng.k_cache + self.eng.v_cache:
            c[dst, :, :n] = c[src, :, :n]

    def decode(self, rows: dict, dec: list, hi: int) -> torch.Tensor:
        """One step of rows [0, hi): each sequence of `dec` feeds its last token at its next slot; the other
        rows (free, prefilling) feed token 0 at their next free slot -> logits [hi, V]."""
        size = next(s for s in self.sizes if s >= hi)
        toks, at = [0] * size, [0] * size
        for r, s in rows.items():
            if r < size:
                at[r] = min(s.n_cached, self.eng.ecfg.max_seq_len - 1)
        st = self.eng.logits_state(size, max_keys=max(at) + 1)  # a captured one: each size's ranges exist
        for s in dec:
            toks[s.row] = s.tokens[-1]
        st.tok.copy_(torch.tensor(toks, dtype=torch.long).pin_memory()[:, None], non_blocking=True)
        st.pos.copy_(torch.tensor(at, dtype=torch.int32).pin_memory(), non_blocking=True)
        st.graph.replay()
        self.logits = st.logits
        return st.logits[:hi]

    def sample(self, seqs: list) -> tuple[list[int], list[float], list | None, list | None]:
        """The next token of each of `seqs` (sequences of the last `decode`, without penalties) from that step's
        logits, through the captured sampler: (tokens, log-probabilities, top-logprob ids, top log-probabilities;
        the last two None when no row asks for them), each a list in the order of `seqs`."""
        from bitnetlm.generate.graph_sampler import ContinuousSampler

        if self.sampler is None:
            b, v = self.eng.ecfg.max_batch, self.logits.shape[1]
            self.sampler = ContinuousSampler(b, v, self.eng.ecfg.max_seq_len, self.device, self.logits.dtype)
        rows = {}
        for s in seqs:
            p = s.group.req.params
            rows[s.row] = (s, p, s.generator, p.max_tokens - len(s.generated))  # the draws it may still need
        gs = self.sampler.sample(self.logits, rows)
        out = [gs.tok, gs.lp, *((gs.top_i, gs.top_v) if gs.top_n else ())]  # every row's: picked on the host
        host = [t.to("cpu", non_blocking=True) for t in out]  # (one sync for all of them below)
        torch.cuda.current_stream(self.device).synchronize()
        lists = [[v[s.row] for s in seqs] for v in (t.tolist() for t in host)]
        return (lists[0], lists[1], *(lists[2:] if gs.top_n else (None, None)))
