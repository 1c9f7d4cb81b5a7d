"""Tensor parallelism (Megatron-style) over a process group: a loaded model sharded in place across ranks.

`init_tensor_parallel(size, device)` joins the group torchrun started (gloo on the CPU, NCCL on CUDA);
`shard_(model, tp)` keeps this rank's heads, MLP columns and vocabulary rows. The runner of a sharded model
(`runtime.tp`) runs the engine on rank 0 and replays its calls on the other ranks.
"""

from bitnetlm.parallel.group import TPGroup, add_tp_argument, init_tensor_parallel, tensor_parallel
from bitnetlm.parallel.shard import check_shardable, group_of, shard_

__all__ = [
    "TPGroup",
    "add_tp_argument",
    "check_shardable",
    "group_of",
    "init_tensor_parallel",
    "shard_",
    "tensor_parallel",
]
