"""bitnet-lm: load, run, serve, train and convert 1.58-bit (ternary) language models and encoders.

Kept lean: importing this package imports torch but never Triton, never initialises CUDA.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy re-exports so `import bitnetlm` stays cheap.
    if name in ("load", "save"):
        from bitnetlm import loading

        return getattr(loading, name)
    if name in ("generate", "stream_generate", "batch_generate"):
        import importlib

        pkg = importlib.import_module("bitnetlm.generate")  # a callable package: bitnetlm.generate(...) works
        return pkg if name == "generate" else getattr(pkg, name)
    if name in ("quantize_", "convert_"):
        from bitnetlm.train import qat

        return getattr(qat, name)
    if name == "embed":
        from bitnetlm.embedding import embed

        return embed
    if name == "RuntimeConfig":
        from bitnetlm.runtime.config import RuntimeConfig

        return RuntimeConfig
    if name in ("BitLinear", "PackingFormat"):
        from bitnetlm import quant

        return getattr(quant, name)
    raise AttributeError(f"module 'bitnetlm' has no attribute {name!r}")


__all__ = [
    "load",
    "save",
    "generate",
    "stream_generate",
    "batch_generate",
    "embed",
    "quantize_",
    "convert_",
    "BitLinear",
    "PackingFormat",
    "RuntimeConfig",
]
