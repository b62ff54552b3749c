"""A checkpoint's tensors as torch views of its files, mapped, never read whole.

A load copies each rank's pieces out of these views (layoutlang/runtime/bucket.py's local
copies), so the kernel reads the pages those pieces touch and nothing else: no
whole tensor, no whole file, on any rank. A save writes through writable views
of preallocated files (`create`). The maps are private for reading
(`ACCESS_COPY`: a stray write never reaches the file) and shared for writing.

Each entry becomes a view of the torch dtype its safetensors dtype names, shaped
as its header says; a quantized `Stored` becomes its format's class from
layoutlang/runtime/quant.py (data and scales, each a view of its own entry), as a refit's
caller would pass it. An entry whose offset is not a multiple of its element
size cannot be a typed view: it is read into memory instead (safetensors itself
writes aligned data; a hand-made file may not be).
"""

from __future__ import annotations

import mmap
import os
from contextlib import contextmanager

import torch

from ..runtime.quant import FORMATS
from .describe import Checkpoint, Stored
from .headers import CheckpointError, Entry

TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
         "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
         "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
         "BOOL": torch.bool}


class Mapped:
    """Open maps of a checkpoint's files (one per file), closed together."""

    def __init__(self, paths: dict[str, str], *, write: bool = False):
        self.write = write
        self._maps: dict[str, mmap.mmap] = {}
        self._raw: dict[str, torch.Tensor] = {}
        for name, path in paths.items():
            with open(path, "r+b" if write else "rb") as fh:
                if os.fstat(fh.fileno()).st_size == 0:
                    self._raw[name] = torch.empty(0, dtype=torch.uint8)
                    continue
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY)
            self._maps[name] = m
            self._raw[name] = torch.frombuffer(m, dtype=torch.uint8)

    def entry(self, e: Entry) -> torch.Tensor:
        """The entry's elements: a view of the file (or, misaligned and read-only, a copy)."""
        dtype = TORCH[e.dtype]
        raw = self._raw[e.file][e.begin:e.end]
        if e.begin % dtype.itemsize:
            if self.write:
                raise CheckpointError(f"{e.file}: key `{e.key}`: offset {e.begin} is not a multiple of "
                                      f"{dtype.itemsize} bytes")
            raw = raw.clone()
        return raw.view(dtype).reshape(e.shape)

    def stored(self, t: Stored):
        """A layout tensor of the checkpoint: a plain view, or its quantized format's class."""
        data = self.entry(t.data)
        if t.dtype not in FORMATS:
            return data
        cls, parts = FORMATS[t.dtype]
        if not t.scales:  # fp8 without a scale tensor: the stored numbers are the values
            return cls(data, torch.ones(1, dtype=torch.float32))
        data = data.reshape(*t.shape[:-1], -1) if t.dtype == "mxfp4" else data  # X_blocks [..., G, 16]
        scales = [self.entry(s).reshape(p.shape(t.dtype, t.shape)) if p.grid.block else self.entry(s).reshape(1)
                  for s, p in zip(t.scales, parts[1:])]
        return cls(data, *scales)

    def flush(self) -> None:
        for m in self._maps.values():
            m.flush()

    def close(self) -> None:
        self._raw.clear()  # the views go first: a map with exported buffers cannot close
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the map closes when it goes
                pass
        self._maps.clear()


@contextmanager
def mapped(ckpt: Checkpoint, names=None):
    """{layout NAME: tensor view} of `ckpt` (every tensor, or those in `names`), the maps open
    while the block runs."""
    wanted = [t for t in ckpt.tensors if names is None or t.name in names]
    files = {e.file for t in wanted for e in t.entries}
    m = Mapped({f.name: f.path for f in ckpt.files if f.name in files})
    try:
        yield {t.name: m.stored(t) for t in wanted}
    finally:
        m.close()


__all__ = ["Mapped", "mapped", "TORCH"]
