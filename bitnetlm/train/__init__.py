"""Training: data shards, QAT (`quantize_` / `convert_`), the loop with checkpoint/resume, distillation, eval.

    from bitnetlm.train import TrainConfig, train, prepare_data, quantize_, convert_
    prepare_data(["corpus/"], "tokenizer.json", "data/corpus")            # -> memmap token shards
    train(TrainConfig(data="data/corpus", model_config={...}, out_dir="runs/x"))   # or `bitnet train x.yaml`

Modules: data (shards, batches), qat (quantize_/convert_), config (TrainConfig), schedule, optim (Lion and
the optimizers the config names), distill, checkpoint, distributed, loop (Trainer/train), export (packed
inference format), eval (perplexity, MC).
"""

from bitnetlm.train.qat import QuantizeConfig, convert_, quantize_, set_quant_lambda

# name -> module for the lazily imported parts (the loop pulls in tqdm, torch.distributed, tensorboard)
_LAZY = {
    "train": "bitnetlm.train.loop",
    "Trainer": "bitnetlm.train.loop",
    "TrainConfig": "bitnetlm.train.config",
    "prepare_data": "bitnetlm.train.data",
    "PrepareConfig": "bitnetlm.train.data",
    "train_tokenizer": "bitnetlm.train.data",
    "TokenShards": "bitnetlm.train.data",
    "PackedBatches": "bitnetlm.train.data",
    "export_model": "bitnetlm.train.export",
    "Lion": "bitnetlm.train.optim",
    "perplexity": "bitnetlm.train.eval",
    "multiple_choice": "bitnetlm.train.eval",
    "evaluate": "bitnetlm.train.eval",
}

__all__ = ["QuantizeConfig", "convert_", "quantize_", "set_quant_lambda", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bitnetlm.train' has no attribute {name!r}")
