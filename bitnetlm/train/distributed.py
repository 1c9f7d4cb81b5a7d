"""Process-group setup and model wrapping: one CPU, one GPU, or `torchrun` with DDP / FSDP2.

The same command runs everywhere: under torchrun (WORLD_SIZE > 1 in the environment) the process
group is initialised (NCCL on CUDA, gloo on CPU) and the model is wrapped; otherwise nothing happens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mode: str = "none"  # none | ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", mode: str = "auto") -> DistInfo:
    """Initialise the process group if launched by torchrun; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if mode == "auto":
        mode = "ddp" if world > 1 else "none"
    if world > 1 and mode == "none":
        raise ValueError(f"distributed 'none' but launched with WORLD_SIZE={world}; use ddp or fsdp")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None
        )
    if world == 1 and mode == "fsdp" and not dist.is_initialized():
        # FSDP2 needs a process group even for one process (a convenient way to test the code path)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    return DistInfo(rank, world, local, dev, mode if (world > 1 or mode == "fsdp") else "none")


def wrap(model: nn.Module, info: DistInfo, block_list: nn.ModuleList | None = None) -> nn.Module:
    """DDP: replicate; FSDP2: `fully_shard` every transformer block, then the root."""
    if info.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if info.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        if block_list is not None:
            for block in block_list:
                fully_shard(block)
        fully_shard(model)
        return model
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return (
        model.module
        if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel)
        else model
    )


def all_reduce_mean(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= info.world_size
    return x


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> tuple[dict, dict]:
    """(model, optimizer) state dicts, unsharded, keyed by parameter name (same on 1 or N processes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=info.mode == "fsdp")
    return get_state_dict(model, optimizer, options=opts)


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict, info: DistInfo
) -> None:
    """Load a full optimizer state dict (keyed by parameter name) into a plain, DDP or FSDP2 setup."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
