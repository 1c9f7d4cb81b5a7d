"""RuntimeConfig: how a model runs (device, dtypes, kernel backend, threads, batch and context), validated once.

One object carries every runtime option from where it is given (`bitnetlm.load(path, **options)`, the CLI's
shared argument group, `bitnet serve`'s flags) to where it is used (the Runner for the device), so that no
option is parsed twice or stashed on a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
KV_CACHE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
_KV_ALIASES = {"": "auto", "bfloat16": "bf16", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
HEAD_DTYPES = ("bf16", "int8")
WEIGHTS_LAYOUTS = ("auto", "2bit", "base3")
BACKENDS = ("reference", "cpu", "triton")


def _dtype_name(value) -> str | None:
    if value is None or isinstance(value, str) and value in ("", "auto"):
        return None
    if isinstance(value, torch.dtype):
        for name, dt in DTYPES.items():
            if dt is value:
                return name
        raise ValueError(f"--dtype {value}: expected one of {', '.join(DTYPES)}")
    name = _DTYPE_ALIASES.get(str(value), str(value))
    if name not in DTYPES:
        raise ValueError(f"--dtype {value!r}: expected one of {', '.join(DTYPES)}")
    return name


def _kv_name(value) -> str:
    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        for name, dt in KV_CACHE_DTYPES.items():
            if dt is value:
                return name
        raise ValueError(f"--kv-cache-dtype {value}: expected auto, bf16 or fp8")
    name = _KV_ALIASES.get(str(value), str(value))
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {value!r}: expected auto, bf16 or fp8")
    return name


def kv_cache_dtype(value) -> torch.dtype | None:
    """A --kv-cache-dtype value -> the cache's element type (None: the activations')."""
    return KV_CACHE_DTYPES[_kv_name(value)]


def available_devices() -> list[str]:
    """The devices bitnet-lm can run on here: cpu, and cuda:N for each visible GPU."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{i}" for i in range(n))]


def resolve_device(device) -> torch.device:
    """`auto` -> cuda when a GPU is present, else cpu; anything else is checked against what this machine has
    (a ValueError naming the devices available, also for mps, metal, xpu, ... which bitnet-lm does not run on)."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    have = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: bitnet-lm runs on cpu or cuda[:N]; available here: {have}")
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} is not available here (available: {have})")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: no such GPU here (available: {have})")
    return dev


@dataclass(frozen=True)
class RuntimeConfig:
    """How to run a model. Every field has a default that picks the best for the machine.

    device: auto | cpu | cuda | cuda:N.  dtype: activations (None: float32 on CPU, bfloat16 on CUDA).
    backend: ternary kernels, reference | cpu | triton (None: the best available).
    kv_cache_dtype: auto (the activations' dtype) | bf16 | fp8 (CUDA; e4m3, unscaled).
    head_dtype: None | bf16 | int8: storage of the embedding + LM head (CPU: the model's own; CUDA: the graph
      engine's int8 head).  threads: C kernel threads (None: physical cores).
    weights_layout: auto | 2bit | base3: the CPU kernels' ternary weights, 2 or 1.6 bits a weight (auto: the
      faster here, timed at load on the model's own matrices).
    enforce_eager: CUDA without captured graphs (the model's own forward).
    max_batch: sequences decoded together (KV rows).  max_seq_len: context (None: the model's).
    kv_tokens: a paged KV cache (the CPU's fused step, the CUDA engine) of this many positions shared by every row,
      allocated in blocks of kv_block_size positions as tokens arrive, with prompt prefixes shared between rows (0:
      a static cache of max_seq_len positions per row; None: the default, which is static offline and paged in the
      CPU server).
    """

    device: str = "auto"
    dtype: str | None = None
    backend: str | None = None
    kv_cache_dtype: str = "auto"
    head_dtype: str | None = None
    threads: int | None = None
    weights_layout: str = "auto"
    enforce_eager: bool = False
    max_batch: int = 8
    max_seq_len: int | None = None
    kv_tokens: int | None = None
    kv_block_size: int = 16

    def __post_init__(self):
        dev = self.device
        if isinstance(dev, torch.device):
            dev = str(dev)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        set_("device", str(dev or "auto"))
        set_("dtype", _dtype_name(self.dtype))
        set_("kv_cache_dtype", _kv_name(self.kv_cache_dtype))
        if self.backend in ("", "auto"):
            set_("backend", None)
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.head_dtype in ("", "auto", "fp", "float"):
            set_("head_dtype", None)
        if self.head_dtype is not None and self.head_dtype not in HEAD_DTYPES:
            raise ValueError(
                f"head_dtype: expected one of {', '.join(HEAD_DTYPES)}, found {self.head_dtype!r}"
            )
        if self.weights_layout in (None, ""):
            set_("weights_layout", "auto")
        if self.weights_layout not in WEIGHTS_LAYOUTS:
            raise ValueError(
                f"--weights-layout {self.weights_layout!r}: expected one of {', '.join(WEIGHTS_LAYOUTS)}"
            )
        for name, low in (
            ("threads", 1),
            ("max_batch", 1),
            ("max_seq_len", 2),
            ("kv_tokens", 0),
            ("kv_block_size", 1),
        ):
            v = getattr(self, name)
            if v is None and name not in ("max_batch", "kv_block_size"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                flag = {"max_seq_len": "ctx-size"}.get(name, name.replace("_", "-"))
                raise ValueError(f"--{flag} {v!r}: expected an integer >= {low}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"--enforce-eager {self.enforce_eager!r}: expected true or false")

    def replace(self, **changes) -> RuntimeConfig:
        return dataclasses.replace(self, **changes)

    # ---- resolved views (one place for every default) -----------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    def kv_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model whose activations are `activations`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or activations
