"""Third-party packages that a feature needs, and the one-line error naming the extra that installs them.

The default install carries every package a documented command needs; the extras of pyproject.toml name them
again per feature (and add the optional ones: onnxruntime, tensorboard), so that `pip install "bitnet-lm[EXTRA]"`
always repairs an environment that lacks one.
"""

from __future__ import annotations

import importlib

# import name -> (pip name, extra)
PACKAGES = {
    "fastapi": ("fastapi", "serve"),
    "starlette": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "pydantic": ("pydantic", "serve"),
    "websockets": ("websockets", "serve"),
    "grpc": ("grpcio", "grpc"),
    "gguf": ("gguf", "gguf"),
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "yaml": ("pyyaml", "train"),
    "tensorboard": ("tensorboard", "train"),
    "huggingface_hub": ("huggingface_hub", "hub"),
    "ray": ("ray", "ray"),
    "llguidance": ("llguidance", "structured"),
}


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


def require(module: str, feature: str):
    """Import and return `module`, or raise MissingDependency saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(message(module, feature, e), name=module) from None


def describe(error: ImportError, feature: str) -> str | None:
    """The one-line message for an ImportError of a known optional package raised while running `feature`
    (None for any other module: that is a bug, not a missing extra)."""
    root = (error.name or "").split(".")[0]
    return message(root, feature, error) if root in PACKAGES else None
