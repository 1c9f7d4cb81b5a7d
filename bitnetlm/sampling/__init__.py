"""Sampling: per-request parameters, logit processing and a batched sampler with per-row random streams."""

from bitnetlm.sampling.sampler import (
    RowRandom,
    SampleOutput,
    SamplingParams,
    process_logits,
    sample,
)

__all__ = ["RowRandom", "SampleOutput", "SamplingParams", "process_logits", "sample"]
