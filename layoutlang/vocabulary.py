"""The words of the `.layout` language, each listed once.

Every part that knows a word reads it from here: the parser (reserved words),
the pygments lexer (highlighting), the IR (dtype sizes) and elaboration
(dtype names, functions). The grammar file keeps its keywords as literal
tokens, as Lark needs them; tests/test_parser.py checks that they are exactly
`KEYWORDS`.

>>> "over" in KEYWORDS and "tensor" in KEYWORDS
True
>>> DTYPE["mxfp8"].element_bits, DTYPE["mxfp8"].last_dim_multiple, DTYPE["nvfp4"].last_dim_multiple
(8, 32, 16)
>>> DTYPE["fp8_b128"].min_dims, DTYPE["fp8_b128"].last_dim_multiple
(2, 1)
>>> FUNCTIONS["min"].arity_text, FUNCTIONS["cdiv"].arity_text
('2 or more', '2')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# Reserved everywhere: never a name, an axis, a part or a loop variable.
KEYWORDS = ("layout", "include", "arg", "const", "mesh", "at", "default", "dtype", "tensor", "as", "on",
            "for", "in", "over", "sizes", "pad", "chunk", "align", "local",
            "transposed", "ragged", "balanced", "cyclic", "flat")  # v2: `transposed` (LANGUAGE.md 8.3), `ragged` (8.5),
# `balanced` and `cyclic` (docs/language.md 14.8), `flat` (14.9)


@dataclass(frozen=True)
class ScaleGrid:
    """One kind of scale a quantized dtype stores beside its elements (LANGUAGE.md 4, 4.1).

    `block`: elements per scale along the LOCAL trailing dims, the last dim
    last: (32,) is one scale per 32 consecutive elements of the last dim,
    (128, 128) one per 128 x 128 block of the last two dims (leading dims are
    a batch: one grid per index); () is one scale for the whole local tensor.
    `partial`: edge blocks may be partial (the last dims need not be whole
    blocks); otherwise the local last dim must be a multiple of the block.
    `code`: how one scale is stored: "fp32" (4 bytes), "e8m0" (1 byte, a power
    of two 2^(s - 127)), "e4m3" (1 byte, an fp8 e4m3 number).

    >>> ScaleGrid((128, 128), "fp32", partial=True).shape((3, 300, 129))
    (3, 3, 2)
    >>> ScaleGrid((32,), "e8m0").shape((8, 64)), ScaleGrid((), "fp32").shape((8, 64))
    ((8, 2), ())
    """

    block: tuple[int, ...]
    code: Literal["fp32", "e8m0", "e4m3"]
    partial: bool = False

    @property
    def bytes(self) -> int:
        return 4 if self.code == "fp32" else 1

    def shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a local tensor of shape `local` (() for one scale)."""
        if not self.block:
            return ()
        k = min(len(self.block), len(local))
        lead, tail = local[:len(local) - k], local[len(local) - k:]
        return lead + tuple(-(-n // b) for n, b in zip(tail, self.block[len(self.block) - k:]))


@dataclass(frozen=True)
class Dtype:
    """An element type a tensor may be stored in.

    `element_bits`: 16 or 32 for plain types, 8 for fp8, 4 for e2m1, whose
    elements are packed two per byte along the local last dim (the even
    element in the low nibble). `scales`: what a quantized tensor stores
    beside its elements, one `ScaleGrid` each; empty for plain types.
    Everything the elaboration checks (`min_dims`, `last_dim_multiple`) and
    every byte count (layoutlang/ir.py `storage_bytes`) follows from these two.
    """

    name: str
    element_bits: int
    scales: tuple[ScaleGrid, ...] = ()

    @property
    def quantized(self) -> bool:
        return bool(self.scales)

    @property
    def per_byte(self) -> int:
        """Elements packed in one byte along the last dim (1 unless elements are narrower than a byte)."""
        return max(1, 8 // self.element_bits)

    @property
    def last_dim_multiple(self) -> int:
        """The local last dim must be a multiple of this: whole blocks of every non-partial
        grid along the last dim, and whole bytes of packed elements."""
        return math.lcm(self.per_byte, *(s.block[-1] for s in self.scales if s.block and not s.partial))

    @property
    def min_dims(self) -> int:
        """Dims a local tensor needs: one per dim of its largest scale block."""
        return max((len(s.block) for s in self.scales), default=0)

    def data_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the stored elements: the local shape, its last dim packed.

        >>> DTYPE["mxfp4"].data_shape((4, 64)), DTYPE["mxfp8"].data_shape((4, 64))
        ((4, 32), (4, 64))
        """
        if self.per_byte == 1 or not local:
            return local
        return local[:-1] + (-(-local[-1] // self.per_byte),)


MXFP8_BLOCK = 32  # elements per block scale of the MX formats (OCP MX v1.0)
NVFP4_BLOCK = 16  # elements per e4m3 block scale of nvfp4
FP8_B128_BLOCK = 128  # the side of fp8_b128's square blocks (DeepSeek-V3's `weight_scale_inv` grid)

_TENSOR_SCALE = ScaleGrid((), "fp32")
DTYPE = {d.name: d for d in (
    Dtype("bf16", 16),
    Dtype("fp16", 16),
    Dtype("fp32", 32),
    Dtype("fp8_e4m3", 8, (_TENSOR_SCALE,)),
    Dtype("fp8_e5m2", 8, (_TENSOR_SCALE,)),
    Dtype("mxfp8", 8, (ScaleGrid((MXFP8_BLOCK,), "e8m0"),)),
    # v2 (LANGUAGE.md 4.1)
    Dtype("fp8_b128", 8, (ScaleGrid((FP8_B128_BLOCK, FP8_B128_BLOCK), "fp32", partial=True),)),
    Dtype("mxfp4", 4, (ScaleGrid((MXFP8_BLOCK,), "e8m0"),)),
    Dtype("nvfp4", 4, (ScaleGrid((NVFP4_BLOCK,), "e4m3"), _TENSOR_SCALE)),
)}
DTYPES = tuple(DTYPE)  # in the order the docs list them
# bytes per element of the dtypes whose elements are whole bytes (every wire dtype)
ELEMENT_BYTES = {d.name: d.element_bits // 8 for d in DTYPE.values() if d.element_bits % 8 == 0}
QUANTIZED = tuple(d.name for d in DTYPE.values() if d.quantized)
DEFAULT_DTYPE = "bf16"


@dataclass(frozen=True)
class Function:
    """A function usable in integer expressions: `min(a, b, ...)`, `cdiv(a, b)`."""

    name: str
    arity: int
    variadic: bool = False  # takes `arity` or more arguments

    @property
    def arity_text(self) -> str:
        return f"{self.arity} or more" if self.variadic else str(self.arity)

    def accepts(self, count: int) -> bool:
        return count >= self.arity if self.variadic else count == self.arity


FUNCTIONS = {f.name: f for f in (
    Function("min", 2, variadic=True),
    Function("max", 2, variadic=True),
    Function("cdiv", 2),     # ceil(a / b)
    Function("roundup", 2),  # cdiv(a, b) * b
    Function("len", 1),      # a table's entries (docs/language.md 14.8)
)}

__all__ = ["KEYWORDS", "ScaleGrid", "Dtype", "DTYPE", "DTYPES", "ELEMENT_BYTES", "QUANTIZED", "MXFP8_BLOCK",
           "NVFP4_BLOCK", "FP8_B128_BLOCK", "DEFAULT_DTYPE", "Function", "FUNCTIONS"]
