"""Checkpoints as a side of a plan: a safetensors directory is a layout; load any layout from it, save any layout to it.

`describe(dir)` reads the headers of every file (never the data) and returns a
`Checkpoint`: the files, each key's file, dtype, shape and byte range, and the
`.layout` text (`.text`) and loaded Layout (`.layout`) of one rank holding every
key whole. `layoutc new checkpoint DIR` prints the text. `load(dir, layout,
tensors, rank=r)` fills one rank's tensors of any layout from the files (each
rank reads only its own pieces); `save(dir, layout, tensors, group=g)` writes
an HF checkpoint from every rank's shards (each byte by one rank, no gather).
docs/checkpoints.md says what is read, checked, paired and written.
"""

from .describe import Checkpoint, Skipped, Stored, describe, describe_layout
from .load import LoadReport, load, plan_load
from .save import SaveReport, checkpoint_files, layout_keys, parse_size, save
from .headers import DTYPE_BITS, CheckpointError, CheckpointFiles, Entry, FileHeader, read_checkpoint, read_header

__all__ = ["load", "save", "plan_load", "LoadReport", "SaveReport", "checkpoint_files", "layout_keys",
           "parse_size", "describe", "describe_layout", "Checkpoint", "Stored", "Skipped", "CheckpointError", "Entry",
           "FileHeader", "CheckpointFiles", "DTYPE_BITS", "read_header", "read_checkpoint"]
