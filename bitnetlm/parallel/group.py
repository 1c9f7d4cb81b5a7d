"""The process group a tensor-parallel model runs over, and starting it from torchrun's environment.

gloo on the CPU, NCCL on CUDA (the backend follows the device). Rank 0 leads: it alone runs the engine, and
sends the other ranks each runner call as JSON (`send` / `recv`: a length, then the bytes; no pickle) over a
gloo group of its own, also beside NCCL.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# how long the other ranks wait for rank 0's next call: a server may sit idle for days
CONTROL_TIMEOUT = timedelta(days=365)
_SENDING = threading.Lock()


@dataclass
class TPGroup:
    """rank / size within `group` (None: the default group); `device`: this rank's device, where the model's
    collectives' tensors live; `control`: a gloo group of the same ranks for rank 0's calls (host tensors, and a
    wait without a timeout that matters)."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def send(self, message) -> None:
        """Rank 0: `message` (JSON-serializable) to every other rank (from any thread: one message at a time)."""
        data = json.dumps(message, separators=(",", ":")).encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        with _SENDING:
            dist.broadcast(n, group=self.control, group_src=0)
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self.control, group_src=0
            )

    def recv(self):
        """Ranks other than 0: the next message rank 0 sends."""
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, group=self.control, group_src=0)
        buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, group=self.control, group_src=0)
        return json.loads(buf.numpy().tobytes())


def torchrun_command(size: int) -> str:
    return f"torchrun --nproc-per-node {size} -m bitnetlm.cli ..."


def init_tensor_parallel(size: int, device: str | torch.device = "cpu") -> TPGroup:
    """This process's place in a tensor-parallel group of `size` ranks started by torchrun: the default
    process group (initialized here unless it already is), gloo for `device` cpu, NCCL for cuda, where each rank
    takes GPU LOCAL_RANK."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"--tp {size!r}: expected an integer >= 1")
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError(f"--tp {size} needs one process per rank: run it as `{torchrun_command(size)}`")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != size:
        raise ValueError(f"--tp {size}: torchrun started {world} processes; --nproc-per-node must equal --tp")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ValueError(f"--tp {size}: tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {dev}")
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(dist.get_rank(), dist.get_world_size(), dev, control=control)


@contextlib.contextmanager
def tensor_parallel(size: int, device: str | torch.device = "cpu") -> Iterator[TPGroup | None]:
    """Inside: `init_tensor_parallel(size, device)`'s group (None for size 1: no group, no torchrun needed),
    destroyed on the way out."""
    if size == 1:
        yield None
        return
    tp = init_tensor_parallel(size, device)
    try:
        yield tp
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def add_tp_argument(p) -> None:
    """`--tp N` (a command that runs a model through the engine)."""
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over N processes started by `torchrun --nproc-per-node N -m bitnetlm.cli ...` "
        "(gloo on the CPU, NCCL on GPUs; default: 1)",
    )
