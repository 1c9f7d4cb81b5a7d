"""The CUDA runtime: the captured-graph engine (`engine.py`, its weights `weights.py`), its runner (`runner.py`),
its samplers (`graph_sampler.py`), the decode step's tuning (`step_tune.py`) and the CUDA half of `bitnet bench`
(`bench.py`). Importing this package imports neither Triton nor CUDA; its modules do."""
