"""CUDA decode engine: a static or paged KV cache, fused Triton layers, the whole decode step in one CUDA
graph.

Per layer and token the step is: [RMSNorm + int8 quant + q|k|v W2A8 GEMV], [RoPE + KV-cache write],
[split-KV attention, one program per GQA group], [SubLN + quant + o_proj + residual], [RMSNorm + quant + gate|up +
relu^2*up], [SubLN + quant + down_proj + residual] -- six launches, plus one quantization launch per projection
where the tuner finds a separate quant + GEMV faster than the fused one (it times both inside CUDA graphs). At
batch <= 2 and 8-64 the q|k|v projection also rotates and writes the KV cache (decode.py: five launches plus
the quantizations); at batch 1 q|k|v, o and down quantize inside their programs, so a layer is six launches.
These batch ranges, and every other tuning decision of the step, are the engine's `DecodePlan` (`self.plan`:
`EngineConfig.plan`, else the GPU model's, `DecodePlan.for_gpu`), handed to every launcher. The Triton kernels
use programmatic dependent launch, so each one loads its weights while the previous one drains. Then final norm,
LM head (bf16, or int8 per-row scaled), sampling (argmax or exponential-race sampling on the device) and the
bookkeeping (next token, position, output slot) -- all captured once per batch size, replayed with no host
synchronisation and no Python per layer.

`weights="dense"` builds the same engine over full-precision (bf16) matrices (cuBLAS, same graph treatment):
the baseline the ternary path is measured against. Prefill (T > 1) runs the GEMM path and PyTorch SDPA
(flash attention) with a causal mask and always starts at position 0; queries are laid out [B, T, H, D] so the
attention output reaches o_proj without a transpose copy. Over a paged cache the decode kernels read and write
through the block table, a prefill from position 0 attends over its own keys (the RoPE launch's contiguous copy),
and a later chunk over a gathered copy of the row's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from bitnetlm.models.config import ModelConfig
from bitnetlm.runtime.cuda import weights as engine_weights
from bitnetlm.runtime.cuda.graphs import CapturedSteps, DecodeState, prefill_len
from bitnetlm.runtime.paged_rows import gather_blocks

if TYPE_CHECKING:
    from bitnetlm.kernels.triton.plan import DecodePlan


def prefill_attention(q, k, v, start: int = 0, gqa: bool = False) -> torch.Tensor:
    """SDPA for prefill: q [B, H, T, D] at positions start..start+T-1 over keys k, v [B, Hkv, start+T, D].
    From position 0: plain causal, PyTorch's choice of backend, cuDNN's on an H100, the fastest here but it
    builds a plan for every new sequence length (tens of ms each), which is why the engine pads prefill lengths
    (`prefill_len`). A chunk continuing a cached prompt: causal aligned to the last key (query i
    sees keys 0..start+i), which flash attention runs natively with GQA; a dense mask took memory-efficient or
    math attention (a 512-token chunk after 512 cached: 14.8-15.1 against 5.27-5.64 ms, benchmarks/gpu.py
    --depths 0,512, H200, docs/PERF_LOG.md, 2026-12-02)."""
    if not start:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]), enable_gqa=gqa
    )


@dataclass
class EngineConfig:
    max_batch: int = 1
    max_seq_len: int = 1024
    dtype: torch.dtype = torch.bfloat16  # activations, KV cache, embedding/head (bf16 head by default)
    weights: str = "ternary"  # "ternary" (Triton W2A8) or "dense" (cuBLAS, the baseline)
    head: str = "fp"  # "fp" (embedding dtype) or "int8" (per-row scaled int8 embedding + LM head)
    kv_dtype: torch.dtype | None = None  # KV cache: None = dtype, or torch.float8_e4m3fn (unscaled)
    # a paged KV cache of this many blocks of kv_block_size positions; 0: max_seq_len a row
    kv_blocks: int = 0
    kv_block_size: int = 16
    # the decode step's tuning decisions; None: the GPU model's (`DecodePlan.for_gpu`)
    plan: DecodePlan | None = None


def _rows(x):
    """A projection's output rows: x itself, or a deferred one's (`deferred.SplitKSums`) once it is finished."""
    return x if isinstance(x, torch.Tensor) else x.out


def gpu_plan(device: torch.device) -> DecodePlan:
    """The DecodePlan of the GPU model at `device` (its step tables' "plan" sections); the defaults off CUDA."""
    from bitnetlm.kernels.triton.plan import DecodePlan

    if device.type != "cuda":
        return DecodePlan()
    return DecodePlan.for_gpu(torch.cuda.get_device_name(device))


class CudaEngine(CapturedSteps):
    def __init__(self, cfg: ModelConfig, w: engine_weights.Weights, ecfg: EngineConfig):
        layers, embed, final_norm, head = w.layers, w.embed, w.final_norm, w.head
        if cfg.hidden_act not in ("relu2", "silu"):
            raise ValueError(f"CudaEngine: hidden_act {cfg.hidden_act!r} not supported (relu2, silu)")
        self.cfg, self.ecfg, self.layers = cfg, ecfg, layers
        dev = final_norm.device
        self.device = dev
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.final_norm = final_norm
        self.tied = head is None or head.data_ptr() == embed.data_ptr()
        if ecfg.head == "int8":
            self.embed_q, self.embed_s = engine_weights.int8_rows(embed)
            self.embed = None
            if self.tied:
                self.head_q, self.head_s = self.embed_q, self.embed_s
            else:
                self.head_q, self.head_s = engine_weights.int8_rows(head)
            self.head = None
        else:
            self.embed = embed.to(ecfg.dtype)
            self.head = self.embed if self.tied else head.to(ecfg.dtype)
        pos = torch.arange(ecfg.max_seq_len, device=dev, dtype=torch.float32)
        freqs = pos[:, None] * w.inv_freq.to(dev, torch.float32)[None, :]  # [S, D/2]
        self.cos, self.sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        self.scratch = ecfg.max_batch  # one more cache row: where the captured prefills run (prefill_state)
        kv = ecfg.kv_dtype or ecfg.dtype
        if kv not in (ecfg.dtype, torch.float8_e4m3fn):
            raise ValueError(
                f"CudaEngine: KV-cache dtype {kv} not supported ({ecfg.dtype} or torch.float8_e4m3fn)"
            )
        # static: [rows + 1, Hkv, max_seq_len, D]. Paged: pools [blocks + 1, Hkv, block size, D] and a block table
        # [rows + 1, blocks a row] on the device, which the decode kernels read and write through; the pools' last
        # block is the trash, in no row's keeping: every table entry that names no block of the row points there,
        # so a captured step's rows that hold no sequence write there
        self.table = None
        shape = (ecfg.max_batch + 1, self.nkv, ecfg.max_seq_len, self.hd)
        if ecfg.kv_blocks:
            self.trash = ecfg.kv_blocks
            shape = (ecfg.kv_blocks + 1, self.nkv, ecfg.kv_block_size, self.hd)
            per_row = -(-ecfg.max_seq_len // ecfg.kv_block_size)
            self.table = torch.full((ecfg.max_batch + 1, per_row), self.trash, device=dev, dtype=torch.int32)
        self.k_cache = [torch.zeros(shape, device=dev, dtype=kv) for _ in layers]
        self.v_cache = [torch.zeros(shape, device=dev, dtype=kv) for _ in layers]
        self._graphs: dict[tuple, DecodeState] = {}
        self._bufs: dict = {}  # decode.QuantBuf per batch size (fused q|k|v + RoPE input); verify inputs
        self._prefill_pool = None  # the memory pool the prefill graphs share (prefill_state)
        # the DecodePlan every launch of a step follows (benchmarks swap it between captures)
        self.plan = ecfg.plan if ecfg.plan is not None else gpu_plan(dev)

    # ---- construction (engine_weights.py builds the tensors) -------------------------------
    @classmethod
    def from_model(
        cls, model, ecfg: EngineConfig | None = None, device="cuda", share: bool = False
    ) -> CudaEngine:
        """Engine over a bitnetlm CausalLM (ternary BitLinear projections, or nn.Linear for weights="dense").

        share: where the projections already hold the kernels' layout on `device`, the model's BitLinears are
        pointed at row slices of the engine's fused q|k|v and gate|up tensors (o and down are used as they
        are), so the model and the engine hold one copy of the packed weights, not two (0.52 GB for 2B4T)."""
        ecfg = ecfg or EngineConfig()
        w = engine_weights.from_model(model, ecfg.weights, ecfg.dtype, torch.device(device), share)
        return cls(model.config, w, ecfg)

    @classmethod
    def random(
        cls, cfg: ModelConfig, ecfg: EngineConfig | None = None, device="cuda", seed: int = 0
    ) -> CudaEngine:
        """Random weights of `cfg`'s exact shapes, in the real packed layout (benchmarks; no checkpoint needed)."""
        ecfg = ecfg or EngineConfig()
        return cls(
            cfg, engine_weights.random(cfg, ecfg.weights, ecfg.dtype, torch.device(device), seed), ecfg
        )

    def weight_bytes(self) -> dict[str, int]:
        """Bytes resident for weights: projections, embedding, LM head (0 when tied), norms."""
        proj = sum(t.numel() * t.element_size() for L in self.layers for t in (L.qkv, L.o, L.gate_up, L.down))
        proj += sum(
            t.numel() * 4
            for L in self.layers
            for t in (L.qkv_scale, L.o_scale, L.gate_up_scale, L.down_scale)
            if t is not None
        )
        if self.ecfg.head == "int8":
            emb = self.embed_q.numel() + self.embed_s.numel() * 4
            head = 0 if self.tied else self.head_q.numel() + self.head_s.numel() * 4
        else:
            emb = self.embed.numel() * self.embed.element_size()
            head = 0 if self.tied else self.head.numel() * self.head.element_size()
        norms = sum(
            t.numel() * 4
            for L in self.layers
            for t in (L.in_norm, L.post_norm, L.attn_sub_norm, L.ffn_sub_norm)
            if t is not None
        )
        return {
            "projections": proj,
            "embedding": emb,
            "lm_head": head,
            "norms": norms + self.final_norm.numel() * 4,
        }

    def bytes_per_step(self, batch: int) -> int:
        """Weight bytes one decode step must read: every projection and the LM head once, B embedding rows."""
        wb = self.weight_bytes()
        head = wb["lm_head"] if not self.tied else wb["embedding"]
        row = wb["embedding"] // self.cfg.vocab_size
        return wb["projections"] + head + wb["norms"] + batch * row

    # ---- the forward ----------------------------------------------------------------------
    def _lin(
        self, x, w, scale, n, norm=None, residual=None, gated=False, path=None, quant_late=False, defer=False
    ):
        if self.ecfg.weights == "ternary":
            from bitnetlm.kernels.triton.launch import ternary_linear

            return ternary_linear(
                x,
                w,
                scale,
                n,
                norm_weight=norm,
                residual=residual,
                gated=gated,
                act=self.cfg.hidden_act,
                eps=self.eps,
                path=path,
                quant_late=quant_late,
                defer=defer,
                plan=self.plan,
            )
        from bitnetlm.kernels.triton.norm import gated_act, rmsnorm

        if norm is not None:
            x = rmsnorm(x, norm, self.eps, self.plan)
        y = torch.addmm(residual, x, w.t()) if residual is not None else x @ w.t()
        return gated_act(y, self.cfg.hidden_act) if gated else y

    def _embed(self, tok: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(tok, self.embed)
        from bitnetlm.kernels.triton.ends import embed_int8

        return embed_int8(tok, self.embed_q, self.embed_s, self.ecfg.dtype, self.plan)

    def _head(
        self, h: torch.Tensor, argmax: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final RMSNorm and the LM head: float32 logits (argmax: `w8a16_argmax`'s tile maxima and indices)."""
        from bitnetlm.kernels.triton.norm import rmsnorm

        if self.head is not None:
            return F.linear(rmsnorm(h, self.final_norm, self.eps, self.plan), self.head).float()
        from bitnetlm.kernels.triton.head import w8a16_argmax, w8a16_linear

        if argmax:
            return w8a16_argmax(h, self.final_norm, self.eps, self.head_q, self.head_s, plan=self.plan)
        # int16 activations, two int8 MMAs
        return w8a16_linear(h, self.final_norm, self.eps, self.head_q, self.head_s, plan=self.plan)

    def forward(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        last_only: bool = True,
        row0: int = 0,
        start: int = 0,
        last_at: torch.Tensor | None = None,
        head_argmax: bool = False,
        keys: int = 0,
        greedy: tuple | None = None,
        copy_to: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """tok [B, T] at positions pos[b] + t -> float32 logits [B, V] (last token; all T with last_only=False).

        T > 1 (prefill): every row starts at position `start`, and pos must hold it; start > 0 continues a
        prompt whose first `start` tokens are already cached (chunked prefill). row0: the first KV-cache row
        these B rows use (a prompt prefilled into one row of a batch; the captured steps run rows 0..B-1).
        last_at: [1] index of the token whose logits to return (a padded prompt's last real token).
        head_argmax (int8 head): (maxima, indices) of the head's vocabulary tiles instead of logits.
        keys (T = 1): the decode attention's key range (`attention.key_range`; 0: the default splits). keys
        (T > 1): a chunk at the positions in pos, known only on the device (a captured verify), attending over
        cache slots 0..keys-1 with a causal mask built from pos; start is then ignored.
        greedy (int8 head): (tok, out, step, pos) of a greedy step, which the head runs itself (`w8a16_greedy`);
        returns None. copy_to (T > 1, B = 1): int64 [1], a cache row that also receives the keys and values."""
        b, t = tok.shape
        self._check_batch(b, max(start + t, keys if t > 1 else 0))
        if row0 + b > self.ecfg.max_batch + 1:
            raise ValueError(f"CudaEngine.forward: rows {row0}..{row0 + b - 1} exceed the cache's rows")
        h = self._embed(tok.reshape(-1))  # [B*T, hidden]
        if t == 1:
            h = self._decode_layers(h, pos, b, row0, keys)
        else:
            h = self._prefill_layers(h, pos, b, t, row0, start, copy_to, keys)
        if last_at is not None:
            h = h.view(b, t, -1).index_select(1, last_at)[:, 0]  # [B, hidden]
        elif last_only:
            h = h.view(b, t, -1)[:, -1]  # [B, hidden]
        if greedy is not None:
            from bitnetlm.kernels.triton.head import w8a16_greedy

            return w8a16_greedy(
                h, self.final_norm, self.eps, self.head_q, self.head_s, *greedy, plan=self.plan
            )
        return self._head(h, head_argmax)

    def _decode_layers(self, h, pos, b: int, row0: int, keys: int):
        """Every layer of a decode step (one token a row) -> the last layer's output rows."""
        from bitnetlm.kernels.triton.attention import attn_decode
        from bitnetlm.kernels.triton.rope import rope_cache

        plan, nh, nkv, hd = self.plan, self.nh, self.nkv, self.hd
        ternary = self.ecfg.weights == "ternary"
        fused = b <= plan.fused_max_b and ternary and not plan.fused_gap[0] <= b <= plan.fused_gap[1]
        in_row = fused and b <= plan.quant_in_row_max_b  # q|k|v, o, down quantize inside their programs
        # split-K projections left for the next quantization launch to finish (a SplitKSums instead of rows)
        dfr = b <= plan.defer_max_b and not in_row and ternary
        if fused:
            from bitnetlm.kernels.triton.decode import QuantBuf, qkv_rope, quantize_into

            if not in_row and b not in self._bufs:
                self._bufs[b] = QuantBuf(b, self.cfg.hidden_size, self.device)
            xq = self._bufs.get(b)
        for li, L in enumerate(self.layers):
            kc, vc, tab = self._kv(li, row0, b)
            q = torch.empty((b, 1, nh, hd), device=self.device, dtype=self.ecfg.dtype)
            if in_row:  # every program normalizes + quantizes h itself
                qkv_rope(
                    h, b, L.qkv, L.qkv_scale, q, self.cos, self.sin, pos, kc, vc, nh, nkv, L.in_norm, self.eps, plan,
                    table=tab,
                )  # fmt: skip
            elif fused:  # quantize, then q|k|v GEMV + RoPE + KV write in one launch
                quantize_into(h, L.in_norm, xq, self.eps, plan)
                qkv_rope(
                    xq,
                    b,
                    L.qkv,
                    L.qkv_scale,
                    q,
                    self.cos,
                    self.sin,
                    pos,
                    kc,
                    vc,
                    nh,
                    nkv,
                    plan=plan,
                    table=tab,
                )
            else:
                qkv = self._lin(h, L.qkv, L.qkv_scale, (nh + 2 * nkv) * hd, norm=L.in_norm)  # [B, (H+2Hkv)*D]
                rope_cache(qkv, self.cos, self.sin, pos, q, kc, vc, nh, nkv, 1, None, row0, None, plan, tab)
            h = _rows(h)  # the residual rows (a deferred down's: finished by the quantization above)
            o = torch.empty((b, nh, hd), device=h.device, dtype=h.dtype)
            # the attention pulls gate|up's weights into L2 (plan.attn_pf_table), at batches in
            # attn_pf_down_batches down's too, at batch <= attn_pf_qkv_max_b the next layer's q|k|v (the last
            # layer's: the first's), in the order the step reads them
            pf = None
            if ternary:
                pf = (L.gate_up,) + ((L.down,) if b in plan.attn_pf_down_batches else ())
                if b <= plan.attn_pf_qkv_max_b:
                    pf += (self.layers[(li + 1) % len(self.layers)].qkv,)
            attn_decode(
                q.view(b, nh, hd), kc, vc, pos, o, 1.0 / math.sqrt(hd), keys, pf, plan=plan, table=tab
            )
            last = li + 1 == len(self.layers)  # the head's quantization takes rows
            h = self._layer_tail(
                h, o.view(b, nh * hd), L, "row" if in_row else None, b, dfr, dfr and not last
            )
        return h

    def _prefill_layers(self, h, pos, b: int, t: int, row0: int, start: int, copy_to, keys: int = 0):
        """Every layer of a prefill of t > 1 tokens a row from `start` (0: a prompt's first chunk; else a chunk
        continuing it; keys > 0: a chunk at the device positions pos over cache slots 0..keys-1, see forward)
        -> the last layer's output rows [B*T, hidden]."""
        from bitnetlm.kernels.triton.rope import rope_cache

        plan, nh, nkv, hd = self.plan, self.nh, self.nkv, self.hd
        tp = prefill_len(t)  # padded length (cache slots t..tp-1 hold finite K/V)
        tp = tp if tp <= self.ecfg.max_seq_len else t
        # a prefill from 0 over a cache of another dtype (float8): the attention's K/V, reused by every layer;
        # pad slots zeroed, since a masked NaN still poisons p @ V
        kv16, mask = None, None
        if keys:  # query i sees keys 0..pos + i: static shapes, so the chunk can be captured for any position
            slots = torch.arange(keys, device=self.device)
            at = pos[:1].long() + torch.arange(t, device=self.device)
            mask = slots[None, :] <= at[:, None]  # [T, keys]
        elif not start and (self.k_cache[0].dtype != self.ecfg.dtype or self.table is not None):
            new = torch.empty if tp == t else torch.zeros  # (a paged cache: the chunk's own operands)
            kv16 = new((2, b, nkv, tp, hd), device=self.device, dtype=self.ecfg.dtype).unbind(0)
        for li, L in enumerate(self.layers):
            kc, vc, tab = self._kv(li, row0, b)
            q = torch.empty((b, t, nh, hd), device=self.device, dtype=self.ecfg.dtype)
            qkv = self._lin(h, L.qkv, L.qkv_scale, (nh + 2 * nkv) * hd, norm=L.in_norm)  # [B*T, (H+2Hkv)*D]
            rope_cache(qkv, self.cos, self.sin, pos, q, kc, vc, nh, nkv, t, copy_to, row0, kv16, plan, tab)
            if keys:
                kp, vp = self._keys(kc, vc, tab, keys, q.dtype)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), kp, vp, attn_mask=mask, enable_gqa=nh != nkv
                )  # [B, H, T, D]
                o = o.transpose(1, 2).reshape(b * t, nh * hd)
            elif not start:  # from position 0: queries and keys padded to tp (see prefill_len)
                qp = q
                if tp != t:  # real query i sees keys 0..i only: the pad rows never reach the real ones
                    qp = q.new_zeros((b, tp, nh, hd))
                    qp[:, :t] = q
                kp, vp = kv16 if kv16 is not None else (kc[:, :, :tp], vc[:, :, :tp])
                o = prefill_attention(qp.transpose(1, 2), kp, vp, gqa=nh != nkv)
                o = o.transpose(1, 2)[:, :t].reshape(b * t, nh * hd)  # [B*T, H*D]; no copy when tp == t
            else:
                kp, vp = self._keys(kc, vc, tab, start + t, q.dtype)
                o = prefill_attention(q.transpose(1, 2), kp, vp, start, nh != nkv)  # [B, H, T, D]
                o = o.transpose(1, 2).reshape(b * t, nh * hd)
            h = self._layer_tail(h, o, L, None, b, False, False, prefill=True)
        return h

    def _kv(self, li: int, row0: int, b: int):
        """Layer li's (k, v, block table) for rows row0..row0+b-1: contiguous row views and None, or a paged
        cache's pools and the rows' block table."""
        if self.table is None:
            return self.k_cache[li][row0 : row0 + b], self.v_cache[li][row0 : row0 + b], None
        return self.k_cache[li], self.v_cache[li], self.table[row0 : row0 + b]

    @staticmethod
    def _keys(kc, vc, tab, n: int, dtype):
        """K and V of positions 0..n-1 of the rows (`_kv`) in the attention's dtype."""
        if tab is None:
            return kc[:, :, :n].to(dtype), vc[:, :, :n].to(dtype)
        return gather_blocks(kc, tab, n).to(dtype), gather_blocks(vc, tab, n).to(dtype)

    def _layer_tail(self, h, o, L, rp, b: int, defer_o: bool, defer_down: bool, prefill: bool = False):
        """A layer after its attention: o (+ the residual), then gate|up and down (+ the residual). rp: the row
        path of o and down ("row": quantizing inside their programs); defer_*: split-K projections left for the
        next quantization launch to finish."""
        h = self._lin(
            o,
            L.o,
            L.o_scale,
            h.shape[-1],
            norm=L.attn_sub_norm,
            residual=h,
            path=rp,
            # where the attention lets the next kernels launch early again, o launches after its
            # quantization's own wait (plan.attn_late_max_b)
            quant_late=not prefill and b > self.plan.attn_late_max_b,
            defer=defer_o,
        )
        # (gate|up is never deferred: one program a row finishing 2 x intermediate sums measured slower than
        # the split-K tail it saves)
        g = self._lin(h, L.gate_up, L.gate_up_scale, self.cfg.intermediate_size, norm=L.post_norm, gated=True)
        h = _rows(h)
        return self._lin(
            g, L.down, L.down_scale, h.shape[-1], norm=L.ffn_sub_norm, residual=h, path=rp, defer=defer_down
        )

    # ---- sampling and the captured decode step ---------------------------------------------
    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> first index of the maximum [B], as `argmax`, in two wide passes: a single-row
        argmax over 128k entries runs on one block (~27 us on an H200); row-chunk maxima then the best chunk."""
        b, v = logits.shape
        r = next((r for r in (256, 192, 128, 64) if v % r == 0 and v // r >= 64), 0)
        if not r:
            return logits.argmax(dim=-1)
        vals, idx = logits.view(b, r, v // r).max(dim=-1)  # first maximum inside each chunk
        j = vals.argmax(dim=-1, keepdim=True)  # first chunk holding the maximum
        return (j * (v // r) + idx.gather(1, j)).squeeze(1)

    @staticmethod
    def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0) -> torch.Tensor:
        """Next tokens [B] on the device (no host sync): argmax, or exponential-race sampling."""
        if temperature <= 0:
            return CudaEngine.argmax(logits)
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return CudaEngine.argmax(probs / torch.empty_like(probs).exponential_(1.0))

    def _check_batch(self, b: int, t: int) -> None:
        if b > self.ecfg.max_batch:
            raise ValueError(f"CudaEngine: batch {b} exceeds max_batch {self.ecfg.max_batch}")
        if t > self.ecfg.max_seq_len:
            raise ValueError(f"CudaEngine: {t} positions exceed max_seq_len {self.ecfg.max_seq_len}")
