"""The CUDA engine's paged KV cache: per layer, pools [blocks + 1, Hkv, block size, D] and one block table
[rows + 1, blocks a row] on the device (int32), which the decode kernels read and write through
(`kernels.triton.attention.attn_decode(table=...)`, `rope_cache`, `qkv_rope`). Position p of row r is offset
p % block size of block table[r, p // block size]. The pools' last block (`trash`) is in no row's keeping: table
entries that name no block of the row point there, so a captured step's rows that hold no sequence write there.
Prefill attention reads a row's earlier keys as a contiguous copy (`gather`); the tensors here stay on the device,
so every function may run inside a captured graph.
"""

from __future__ import annotations

import torch


def pools(blocks: int, block_size: int, n_kv: int, head_dim: int, layers: int, dtype, device):
    """(k pools, v pools): per layer [blocks + 1, n_kv, block_size, head_dim], zeroed (the last: the trash)."""
    shape = (blocks + 1, n_kv, block_size, head_dim)
    k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    return k, v


def gather(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0..n-1 of the rows of `table` [B, blocks a row] as a contiguous [B, Hkv, n, D] copy."""
    bs = pool.shape[2]
    nb = -(-n // bs)
    x = pool[table[:, :nb].long()]  # [B, nb, Hkv, bs, D]
    b, hkv, d = table.shape[0], pool.shape[1], pool.shape[3]
    return x.permute(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, d)[:, :, :n]


def scatter(pool: torch.Tensor, table_row: torch.Tensor, src: torch.Tensor, start: int) -> None:
    """src [Hkv, n, D] into positions start..start+n-1 of the row whose block table is `table_row` [blocks]."""
    bs = pool.shape[2]
    p = torch.arange(start, start + src.shape[1], device=pool.device)
    pool[table_row[p // bs].long(), :, p % bs] = src.permute(1, 0, 2).to(pool.dtype)


def first_blocks(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The blocks holding positions 0.. of rows 0..rows-1 (int64 [rows]): what a capture's warm-up steps write."""
    return table[:rows, 0].long()
