"""Text generation: generate, stream_generate and batch_generate (re-exports the tokenizer and sampling types)."""

from bitnetlm.generate.generate import (
    GenerationChunk,
    GenerationResult,
    batch_generate,
    format_stats,
    generate,
    make_params,
    prompt_to_ids,
    stream_generate,
)
from bitnetlm.sampling import SampleOutput, SamplingParams, process_logits, sample
from bitnetlm.text import StreamDetokenizer, Tokenizer

__all__ = [
    "GenerationChunk",
    "GenerationResult",
    "SampleOutput",
    "SamplingParams",
    "StreamDetokenizer",
    "Tokenizer",
    "batch_generate",
    "format_stats",
    "generate",
    "make_params",
    "process_logits",
    "prompt_to_ids",
    "sample",
    "stream_generate",
]


class _CallableModule(__import__("types").ModuleType):
    # `bitnetlm.generate` is both this package and (lazily re-exported) the generate() function; once the
    # package is imported it shadows the re-export, so calling the package calls generate().
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
