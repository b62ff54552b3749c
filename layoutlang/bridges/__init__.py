"""Bridges to the frameworks that hold real models: Megatron-Core, HF transformers, DTensor.

Each bridge turns a live model into the `.layout` text that describes how it
stores its weights (`describe`) and the tensors a `Refitter` reads or writes
(`tensors`). A bridge imports its framework lazily, inside the call that needs
it: `import layoutlang.bridges.hf` works without transformers installed.
"""

from .families import BridgeError, ConfigError  # no framework import: safe at import time

__all__ = ["BridgeError", "ConfigError"]
