"""The C kernels' thread pool (csrc/threads.c): bit-identical results with 1 to 4 threads, with more threads than
the machine has cores, with a busy process competing for the cores (the pool then runs jobs on the caller alone
for a while), and with library calls from several Python threads at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from oracle import random_model

from bitnetlm.kernels import cpu, prepare
from bitnetlm.kernels.cpu import ops
from bitnetlm.quant import to_inference_
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not cpu.available(), reason="C kernels not built"),
]


@pytest.fixture(scope="module")
def model():
    # 4 heads of 64: from ~128 cached positions the attention of a step is shared out over the pool
    m = random_model(hidden=256, inter=512, max_position_embeddings=256)
    return prepare(to_inference_(m).eval(), backend="cpu")


@pytest.fixture
def threads():
    """Set the pool's thread count inside a test; the count before is restored after."""
    before = cpu.get_num_threads()
    yield cpu.set_num_threads
    cpu.set_num_threads(before)


def workload(model) -> list[torch.Tensor]:
    """Every kind of pool job: ternary GEMV and GEMM, activation quantization of many rows, the three float heads,
    and fused decode steps of 3 rows at staggered positions with threaded attention."""
    g = torch.Generator().manual_seed(1)
    t = torch.randint(-1, 2, (1000, 640), generator=g, dtype=torch.int8)
    packed, scale = cpu.pack_cpu(t), torch.tensor([0.02])
    x = torch.randn(40, 640, generator=g)
    w = torch.randn(700, 640, generator=g)
    q = torch.randint(-127, 128, (700, 640), generator=g, dtype=torch.int8)
    out = [ops.ternary_linear(x[:1], packed, scale, 1000), ops.ternary_linear(x, packed, scale, 1000)]
    out += list(ops.quantize_activations(x))
    out += [
        ops.gemm_float(x[:3], w),
        ops.gemm_float(x[:3], w.bfloat16()),
        ops.gemm_i8row(x[:3], q, w[:, 0].abs()),
    ]
    r = CpuRunner(model, RuntimeConfig(), 3, 200)
    lens = [150, 131, 20]
    logits = r.prefill_many([0, 1, 2], [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens])
    for s in range(3):
        out.append(logits)
        logits = r.decode([0, 1, 2], logits.argmax(-1).tolist(), [n + s for n in lens])
    assert r.fused is not None and r.fused.calls == 4
    return out + [logits]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor], where: str):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{where}: result {i} differs"


def test_any_thread_count_gives_the_same_bits(model, threads):
    threads(1)
    ref = workload(model)
    over = 2 * os.cpu_count() + 1  # more threads than cores
    for n in (2, 3, 4, over):
        assert threads(n) == n
        _assert_equal(ref, workload(model), f"{n} threads")


def test_same_bits_with_a_busy_competitor(model, threads):
    """A busy process on the cores (as on a shared machine): the pool's caller takes the chunks a descheduled
    worker has not claimed, or runs jobs alone, and computes the same results."""
    threads(1)
    ref = workload(model)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        for n in (2, 4):
            threads(n)
            for _ in range(2):
                _assert_equal(ref, workload(model), f"{n} threads beside a busy process")
    finally:
        busy.kill()
        busy.wait()


def test_calls_from_several_threads(model, threads):
    """Fused decode steps, whose attention uses the pool outside the library's call lock, while another Python
    thread runs projections: the pool serves one job at a time, so both get their results (sharing it corrupted
    the steps' attention)."""
    threads(2)
    g = torch.Generator().manual_seed(2)
    t = torch.randint(-1, 2, (2000, 640), generator=g, dtype=torch.int8)
    packed, scale, x = cpu.pack_cpu(t), torch.tensor([0.02]), torch.randn(1, 640, generator=g)
    lens = [230, 190, 250]
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]

    def decode() -> list[torch.Tensor]:
        r = CpuRunner(model, RuntimeConfig(), 3, 256)
        out = [r.prefill_many([0, 1, 2], prompts)]
        for s in range(5):
            out.append(r.decode([0, 1, 2], out[-1].argmax(-1).tolist(), [n + s for n in lens]))
        return out

    ref, ref_y = decode(), ops.ternary_linear(x, packed, scale, 2000)
    stop, wrong = threading.Event(), []

    def projections():
        while not stop.is_set():
            if not torch.equal(ops.ternary_linear(x, packed, scale, 2000), ref_y):
                wrong.append("projection")

    side = threading.Thread(target=projections)
    side.start()
    try:
        for i in range(3):
            _assert_equal(ref, decode(), f"decode {i} beside another thread's projections")
    finally:
        stop.set()
        side.join(60)
    assert not wrong
