"""Training: data shards, QAT (`quantize_` / `convert_`), the loop with checkpoint/resume, distillation, eval."""

from bitnetlm.train.qat import QuantizeConfig, convert_, quantize_, set_quant_lambda

__all__ = ["QuantizeConfig", "TrainConfig", "convert_", "quantize_", "set_quant_lambda", "train"]


def __getattr__(name):
    # the loop pulls in tqdm / distributed / tensorboard: import it only when asked for
    if name == "train":
        from bitnetlm.train.loop import train

        return train
    if name == "TrainConfig":
        from bitnetlm.train.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'bitnetlm.train' has no attribute {name!r}")
