"""Checkpoint formats: hf (safetensors directories), gguf, onnx, native metadata. One name table in names.py."""
