"""How a model runs: a RuntimeConfig (options, validated once) and a Runner for the model's device.

`make_runner(model, config, rows, max_seq_len)` builds the runner every loop drives (`runtime/base.py`):
eager (the model's own forward, any device), cpu (the fused C layer step) or cuda (captured graphs over the
Triton kernels; enforce_eager or a model the engine cannot run falls back to eager). `runner_for` keeps a
model's CUDA runner between calls (rebuilt when a weight changes or a call needs more rows or positions), and
`configure(model, config)` records the options `bitnetlm.load` was given, which every later call on that model
takes unless it passes its own.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

from bitnetlm.runtime.config import RuntimeConfig

log = logging.getLogger(__name__)

_configs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> RuntimeConfig given at load
_runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (runner, fingerprint, modules)
SEQ_ROUND = 1024  # a kept runner's positions grow in steps of this many (fewer rebuilds as requests grow)


def configure(model, config: RuntimeConfig) -> None:
    """The runtime options of `model` for every later call that passes none (what `bitnetlm.load` was given)."""
    _configs[model] = config


def config_for(model, config: RuntimeConfig | None = None) -> RuntimeConfig:
    """`config`, else the options recorded for `model`, else the defaults for the model's device."""
    if config is not None:
        return config
    got = _configs.get(model)
    if got is not None:
        return got
    dev = _device(model)
    return RuntimeConfig(device=str(dev))


def _device(model) -> torch.device:
    return next(itertools.chain(model.parameters(), model.buffers()), torch.zeros(())).device


def make_runner(model, config: RuntimeConfig, rows: int, max_seq_len: int):
    """A new runner for `model` on its device with `rows` KV rows of `max_seq_len` positions."""
    dev = _device(model)
    from bitnetlm.parallel import group_of

    if config.kv_tokens and group_of(model) is not None:
        log.warning("--kv-tokens: a tensor-parallel model's KV cache is static")
    if group_of(model) is not None:  # a tensor-parallel shard: the eager forward, mirrored to the other ranks
        from bitnetlm.runtime.tp import TPRunner

        return TPRunner(model, config, rows, max_seq_len)
    if dev.type == "cuda" and not config.enforce_eager:
        try:
            from bitnetlm.runtime.cuda.engine import gpu_plan
            from bitnetlm.runtime.cuda.runner import CudaRunner
        except ImportError as e:  # (no Triton)
            log.info("no CUDA-graph engine here (%s); using the eager forward", e)
        else:
            plan = gpu_plan(dev)  # (a bad tuning table is the user's error to see, not a reason to fall back)
            try:
                if config.kv_tokens:
                    from bitnetlm.runtime.cuda.paged_runner import PagedCudaRunner

                    return PagedCudaRunner(model, config, rows, max_seq_len, plan)
                return CudaRunner(model, config, rows, max_seq_len, plan)
            except (TypeError, ValueError) as e:
                log.info("the CUDA-graph engine cannot run this model (%s); using the eager forward", e)
    if dev.type == "cpu" and config.kv_tokens:
        from bitnetlm.runtime.paged import paged_runner

        got = paged_runner(model, config, rows, max_seq_len)
        if not isinstance(got, str):
            return got
        log.warning("no paged KV cache for this model (%s); using a static one", got)
    if config.kv_tokens and dev.type != "cpu":
        log.warning("--kv-tokens: the eager forward's KV cache is static")
    if dev.type == "cpu":
        from bitnetlm.runtime.cpu import CpuRunner

        return CpuRunner(model, config, rows, max_seq_len)
    from bitnetlm.runtime.eager import EagerRunner

    return EagerRunner(model, config, rows, max_seq_len)


def serving_config(model, config: RuntimeConfig, rows: int, max_seq_len: int) -> RuntimeConfig:
    """The server's runtime options: on the CPU, without kv_tokens given, a paged KV cache of the positions the
    static cache would hold (rows x max_seq_len: never more memory), whose rows take blocks as their tokens
    arrive and share prompt prefixes. Elsewhere (a GPU, tensor parallelism) `config` as it is."""
    if config.kv_tokens is not None or _device(model).type != "cpu" or _sharded(model):
        return config
    return config.replace(kv_tokens=rows * max_seq_len)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (it cannot be modified in place)
        return -1


def _fingerprint(mods: list) -> tuple:
    """Identity, storage and version of every parameter and buffer of the modules `mods`, and the identity of
    every child: changes when a tensor is modified or replaced, or a submodule swapped."""
    tensors = (t for m in mods for d in (m._parameters, m._buffers) for t in d.values() if t is not None)
    return tuple((id(t), t.data_ptr(), _version(t)) for t in tensors) + tuple(
        id(c) for m in mods for c in m._modules.values()
    )


def runner_for(model, config: RuntimeConfig | None, rows: int, max_seq_len: int):
    """A runner for one offline call. On CUDA the model's runner is kept between calls (building one captures
    graphs and repacks the weights) and rebuilt when a weight changes, the options change, or a call needs more
    rows or positions; elsewhere a new one is cheap."""
    config = config_for(model, config)
    if _device(model).type != "cuda" or config.enforce_eager or _sharded(model):
        return make_runner(model, config, rows, max_seq_len)
    runner, fp0, mods = _runners.get(model, (None, None, None))
    fp = (_fingerprint(mods), config) if mods is not None else None
    if fp is not None and fp0 == fp:
        if runner.rows >= rows and runner.max_seq_len >= max_seq_len:
            return runner
        rows, max_seq_len = max(rows, runner.rows), max(max_seq_len, runner.max_seq_len)
    _runners.pop(model, None)
    del runner  # free the old runner's weights and KV cache before allocating the new one
    mods = list(model.modules())
    max_seq_len = -(-max_seq_len // SEQ_ROUND) * SEQ_ROUND
    new = make_runner(model, config, rows, max_seq_len)
    _runners[model] = (new, (_fingerprint(mods), config), mods)  # after the build: it re-points the weights
    return new


def _sharded(model) -> bool:
    from bitnetlm.parallel import group_of

    return group_of(model) is not None


def kept_runner(model):
    """The runner `runner_for` keeps for `model` (its CUDA runner), or None."""
    return _runners.get(model, (None,))[0]


__all__ = [
    "RuntimeConfig",
    "config_for",
    "configure",
    "kept_runner",
    "make_runner",
    "runner_for",
    "serving_config",
]
