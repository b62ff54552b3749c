"""Checkpoints as a side of a plan: a safetensors directory is a layout (issue 28, first part).

`describe(dir)` reads the headers of every file (never the data) and returns a
`Checkpoint`: the files, each key's file, dtype, shape and byte range, and the
`.layout` text (`.text`) and loaded Layout (`.layout`) of one rank holding every
key whole. `layoutc new checkpoint DIR` prints the text. docs/checkpoints.md
says what is read, checked and paired.
"""

from .describe import Checkpoint, Skipped, Stored, describe, describe_layout
from .headers import DTYPE_BITS, CheckpointError, CheckpointFiles, Entry, FileHeader, read_checkpoint, read_header

__all__ = ["describe", "describe_layout", "Checkpoint", "Stored", "Skipped", "CheckpointError", "Entry",
           "FileHeader", "CheckpointFiles", "DTYPE_BITS", "read_header", "read_checkpoint"]
