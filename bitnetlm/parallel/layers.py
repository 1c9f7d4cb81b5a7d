"""The layers of a tensor-parallel shard whose inputs or outputs are split across ranks (Megatron-style).

q|k|v and gate|up keep plain BitLinear / nn.Linear (their rows split, every rank holding the whole input);
what needs a collective lives here:
  RowParallel       o / down: the input split by columns. Ternary: one all_reduce(MAX) of each token's |x| so
                    every rank quantizes its slice with the whole vector's scale (the integers of one process),
                    the exact integer partial products summed by one all_reduce(SUM), then scaled once.
  GatheredNorm      BitNet's sub-norms over a split dim: the slices all-gathered and normalized whole on every
                    rank, which then quantizes the whole vector itself (no MAX all-reduce) for o / down.
  VocabEmbedding    vocabulary rows split: each rank looks up its own rows, one all_reduce(SUM).
  VocabHead         the LM head's vocabulary rows split: logits all-gathered (padded to equal shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bitnetlm.kernels import cpu as cpu_kernels
from bitnetlm.parallel.group import TPGroup
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.ternary import int_matmul_f32, quantize_activations


class RowParallel(nn.Module):
    """y = x @ W^T with this rank holding columns [lo, hi) of W (a ternary or float linear); x is either this
    rank's slice of the input or the whole input (after a `GatheredNorm`), of which the columns are taken."""

    def __init__(self, linear: nn.Module, lo: int, hi: int, tp: TPGroup):
        super().__init__()
        self.tp, self.lo, self.hi = tp, lo, hi
        self.in_features, self.out_features, self.whole = hi - lo, linear.out_features, linear.in_features
        self.ternary = isinstance(linear, BitLinear)
        if not self.ternary:
            self.weight = nn.Parameter(linear.weight.detach()[:, lo:hi].contiguous(), requires_grad=False)
            return
        t = linear.ternary_weight()[:, lo:hi].contiguous()
        self.register_buffer("weight_scale", linear.scale().detach().float().reshape(1).clone())  # whole W's
        kernel = linear.kernel
        if getattr(kernel, "name", None) == "cpu" and kernel.is_available(t.device):
            self.kernel, self.packed = kernel, kernel.pack(t)  # exact int32 products in C
        else:
            self.kernel, self.packed = (
                None,
                t,
            )  # int8: the products through a float32 GEMM (exact, K < 132000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = x.shape[-1] == self.whole and self.whole != self.in_features
        if not self.ternary:
            y = F.linear(x[..., self.lo : self.hi] if whole else x, self.weight.to(x.dtype))
            dist.all_reduce(y, group=self.tp.group)
            return y
        amax = x.float().abs().amax(dim=-1, keepdim=True)
        if not whole:  # the whole vector's max |x|: the integers a single process computes
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp.group)
        xq, a = quantize_activations(x, amax)
        if whole:
            xq = xq[..., self.lo : self.hi].contiguous()
        if self.kernel is not None:
            from bitnetlm.kernels.cpu import ops

            acc = ops.ternary_matmul_i32(xq, self.packed, self.out_features).float()
        else:
            acc = int_matmul_f32(xq, self.packed)
        # partial sums are integers below 2**24 (127 * K), so the float32 sum is exact in any order
        dist.all_reduce(acc, group=self.tp.group)
        return (acc * (self.weight_scale / a)).to(x.dtype)  # the reference's and the C kernels' operations

    def extra_repr(self) -> str:
        kind = "ternary" if self.ternary else "float"
        return f"columns [{self.lo}, {self.hi}) of {self.whole}, out_features={self.out_features}, {kind}"


class GatheredNorm(nn.Module):
    """`norm` (the model's own RMSNorm) over a dim split across ranks: the slices all-gathered, then the whole
    vector normalized on every rank exactly as one process does (a sum of squares reduced across ranks would
    be summed in another order, and one ulp moves a token's int8 activations downstream)."""

    def __init__(self, norm: nn.Module, tp: TPGroup):
        super().__init__()
        self.norm, self.tp = norm, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.tp.size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp.group)
        return self.norm(torch.cat(parts, dim=-1))


def vocab_rows(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's vocabulary rows [lo, lo + per) (the last shard padded to `per` rows)."""
    per = -(-vocab // tp.size)
    return tp.rank * per, per


def vocab_shard(weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    lo, per = vocab_rows(weight.shape[0], tp)
    out = weight.new_zeros(per, weight.shape[1])
    part = weight.detach()[lo : lo + per]
    out[: part.shape[0]] = part
    return out


class VocabEmbedding(nn.Module):
    """The token embedding with this rank's vocabulary rows."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.vocab, self.tp = weight.shape[0], tp
        self.lo, self.per = vocab_rows(self.vocab, tp)
        self.weight = nn.Parameter(vocab_shard(weight, tp), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.per)
        e = F.embedding(local.clamp(0, self.per - 1), self.weight).masked_fill(~mine[..., None], 0)
        dist.all_reduce(e, group=self.tp.group)  # one rank holds each row; the others add zeros
        return e


class VocabHead(nn.Module):
    """The LM head with this rank's vocabulary rows (tied: the embedding shard's); logits all-gathered."""

    def __init__(self, weight: torch.Tensor, vocab: int, tp: TPGroup):
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight
        fast = w.dtype in (torch.float32, torch.bfloat16) and h.dtype == torch.float32
        if fast and h.device.type == "cpu" and cpu_kernels.available():
            # the C head sums every row alike, as the single-process CPU runner's head does
            from bitnetlm.kernels.cpu import ops

            local = ops.head_float(h, w)
        else:
            local = F.linear(h, w.to(h.dtype))
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]
