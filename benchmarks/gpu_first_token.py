"""Load-to-first-token on the GPU (device machine): a 2B4T-shaped packed HF checkpoint (random weights, the
real offline-packed format, written by benchmarks/make_checkpoint.py if absent) -> load_model on CUDA ->
CudaEngine -> prefill of a prompt -> first token on the host.

    python benchmarks/gpu_first_token.py [--dir DIR] [--prompt 16] [--runs 2]

Each run is a fresh process timed from before `python` starts to the first token on the host (wall clock,
`time.time()` in both processes); the process's exit after it (freeing the GPU memory and the CUDA context) is
shown apart and not counted. The first run pays Triton's compilation and the kernel tuning (both cached on disk),
later runs find them cached, as a second launch of the CLI would. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(path: str, prompt: int) -> None:
    t0_wall = time.time()
    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    from bitnetlm.engine_cuda import CudaEngine, EngineConfig
    from bitnetlm.loading import load_model

    t_import = time.perf_counter()
    model = load_model(path, device="cuda", dtype=torch.bfloat16, backend="triton").eval()
    torch.cuda.synchronize()
    t_load = time.perf_counter()
    eng = CudaEngine.from_model(model, EngineConfig(max_batch=1, max_seq_len=prompt + 64), device="cuda")
    del model
    torch.cuda.synchronize()
    t_engine = time.perf_counter()
    tok = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = eng.sample(eng.forward(tok.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda")))
    first = int(first[0])  # host sync
    t_first = time.perf_counter()
    t_first_wall = time.time()
    print(
        json.dumps(
            dict(
                import_s=t_import - t0,
                load_s=t_load - t_import,
                engine_s=t_engine - t_load,
                first_token_s=t_first - t_engine,
                in_process_s=t_first - t0,
                t0_wall=t0_wall,
                first_wall=t_first_wall,
                token=first,
                weight_gib=sum(eng.weight_bytes().values()) / 2**30,
                gpu=torch.cuda.get_device_name(),
            )
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, ".assets", "bench-2b4t"))
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        child(a.dir, a.prompt)
        return 0
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from make_checkpoint import write_checkpoint

    t = time.perf_counter()
    write_checkpoint(a.dir, "2b4t")
    size = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir))
    print(
        f"checkpoint {a.dir}: {size / 2**30:.2f} GiB ({time.perf_counter() - t:.1f} s to write)", flush=True
    )
    rows = []
    for i in range(a.runs):
        spawn = time.time()
        out = subprocess.run(
            [sys.executable, __file__, "--_child", "--dir", a.dir, "--prompt", str(a.prompt)],
            check=True,
            capture_output=True,
            text=True,
        )
        wall = time.time() - spawn  # to the child's exit
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["wall_s"] = r.pop("first_wall") - spawn  # python starting -> first token
        r["startup_s"] = r.pop("t0_wall") - spawn  # interpreter start, before `import torch`
        r["exit_s"] = wall - r["wall_s"]  # after the first token: exit, GPU memory and context teardown
        r["run"] = i + 1
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(
        f"\nGPU: {rows[0]['gpu']}; 2B4T-shaped packed checkpoint ({size / 2**30:.2f} GiB), prompt {a.prompt} tokens"
    )
    print(
        "\n| run | wall s (process start -> first token) | start s | import s | load s | engine s "
        "| prefill + first token s | exit s (not counted) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['run']} | {r['wall_s']:.2f} | {r['startup_s']:.2f} | {r['import_s']:.2f} | {r['load_s']:.2f} "
            f"| {r['engine_s']:.2f} | {r['first_token_s']:.2f} | {r['exit_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
