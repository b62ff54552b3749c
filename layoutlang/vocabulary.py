"""The words of the `.layout` language, each listed once.

Every part that knows a word reads it from here: the parser (reserved words),
the pygments lexer (highlighting), the IR (dtype sizes) and elaboration
(dtype names, functions). The grammar file keeps its keywords as literal
tokens, as Lark needs them; tests/test_parser.py checks that they are exactly
`KEYWORDS`.

>>> "over" in KEYWORDS and "tensor" in KEYWORDS
True
>>> DTYPE["mxfp8"].element_bytes, DTYPE["mxfp8"].scales
(1, 'block')
>>> FUNCTIONS["min"].arity_text, FUNCTIONS["cdiv"].arity_text
('2 or more', '2')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Reserved everywhere: never a name, an axis, a part or a loop variable.
KEYWORDS = ("layout", "include", "arg", "const", "mesh", "at", "default", "dtype", "tensor", "as", "on",
            "for", "in", "over", "sizes", "pad", "chunk", "align", "local",
            "transposed", "ragged")  # v2: `transposed` (LANGUAGE.md 8.3), `ragged` (8.5)


@dataclass(frozen=True)
class Dtype:
    """An element type a tensor may be stored in.

    `scales`: what a quantized tensor stores beside its elements: "tensor" is
    one fp32 scale for the whole local tensor, "block" one byte (an e8m0
    exponent) per MXFP8_BLOCK consecutive elements; "none" for plain types.
    """

    name: str
    element_bytes: int
    scales: Literal["none", "tensor", "block"]

    @property
    def quantized(self) -> bool:
        return self.scales != "none"


MXFP8_BLOCK = 32  # elements per block scale of a "block"-scaled dtype

DTYPE = {d.name: d for d in (
    Dtype("bf16", 2, "none"),
    Dtype("fp16", 2, "none"),
    Dtype("fp32", 4, "none"),
    Dtype("fp8_e4m3", 1, "tensor"),
    Dtype("fp8_e5m2", 1, "tensor"),
    Dtype("mxfp8", 1, "block"),
)}
DTYPES = tuple(DTYPE)  # in the order the docs list them
ELEMENT_BYTES = {d.name: d.element_bytes for d in DTYPE.values()}
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
)}

__all__ = ["KEYWORDS", "Dtype", "DTYPE", "DTYPES", "ELEMENT_BYTES", "QUANTIZED", "MXFP8_BLOCK",
           "DEFAULT_DTYPE", "Function", "FUNCTIONS"]
