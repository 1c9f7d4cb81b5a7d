"""Third-party packages that a feature needs, and the one-line error naming the extra that installs them.

The default install carries every package a documented command needs; the extras of pyproject.toml name them
again per feature (and add the optional ones: onnxruntime, tensorboard), so that `pip install "bitnet-lm[EXTRA]"`
always repairs an environment that lacks one.
"""

from __future__ import annotations

import importlib
import itertools

# import name -> (pip name, extra)
PACKAGES = {
    "fastapi": ("fastapi", "serve"),
    "starlette": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "pydantic": ("pydantic", "serve"),
    "websockets": ("websockets", "serve"),
    "grpc": ("grpcio", "grpc"),
    "google": ("protobuf", "grpc"),
    "gguf": ("gguf", "gguf"),
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "yaml": ("pyyaml", "train"),
    "tensorboard": ("tensorboard", "train"),
    "huggingface_hub": ("huggingface_hub", "hub"),
    "ray": ("ray", "ray"),
    "llguidance": ("llguidance", "structured"),
}
# import name -> the oldest version our code runs on (pyproject's extras say the same): llguidance 1.7 takes a list
# of end tokens; the committed gRPC stubs refuse an older grpcio (protobuf's gencode likewise)
MINIMUM = {"llguidance": (1, 7), "grpc": (1, 85, 4), "google.protobuf": (7, 35, 1)}


class MissingDependency(ModuleNotFoundError, ValueError):
    """A package a feature needs is not installed. A ValueError too, so the CLI prints it as one line."""


def message(module: str, feature: str, error: ImportError | None = None) -> str:
    root = module.split(".")[0]
    pip_name, extra = PACKAGES.get(root, (root, None))
    fix = f'pip install "bitnet-lm[{extra}]"' if extra else f"pip install {pip_name}"
    absent = error is None or (
        isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == root
    )
    if absent:
        return f"{feature} needs the {pip_name} package, which is not installed: {fix}"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"{feature} needs the {pip_name} package, which fails to import ({first}): pip install --force-reinstall {pip_name}"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, p))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def require(module: str, feature: str):
    """Import and return `module`, or raise MissingDependency saying which extra installs it (also when the
    installed version is older than MINIMUM's)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(message(module, feature, e), name=module) from None
    want = MINIMUM.get(module)
    found = str(getattr(mod, "__version__", ""))
    if want and found and _version(found) < want:
        pip_name, extra = PACKAGES.get(module.split(".")[0], (module, None))
        least = ".".join(map(str, want))
        fix = f'pip install -U "bitnet-lm[{extra}]"' if extra else f'pip install -U "{pip_name}>={least}"'
        raise MissingDependency(f"{feature} needs {pip_name}>={least}, found {found}: {fix}", name=module)
    return mod


def describe(error: ImportError, feature: str) -> str | None:
    """The one-line message for an ImportError of a known optional package raised while running `feature`
    (None for any other module: that is a bug, not a missing extra)."""
    root = (error.name or "").split(".")[0]
    return message(root, feature, error) if root in PACKAGES else None
