"""Bridges to the frameworks that hold real models: Megatron-Core, HF transformers, DTensor.

Each bridge turns a live model into the `.layout` text that describes how it
stores its weights (`describe`) and the tensors a `Refitter` reads or writes
(`tensors`). A bridge imports its framework lazily, inside the call that needs
it: `import layoutlang.bridges.hf` works without transformers installed.
"""
