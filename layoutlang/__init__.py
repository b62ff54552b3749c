"""layoutlang: describe how every weight is sharded; move weights between layouts.

>>> from layoutlang import loads
>>> layout = loads("mesh m (tp=2)\\ntensor w [8 over tp, 4]")
>>> [t.local_shape for t in layout.tensors]
[(4, 4)]
"""

from .diagnostics import LayoutError, ParseError, ElaborationError, UsageError
from .elaborate import load, loads
from .ir import Layout, Mesh, Axis, TensorIR, DimIR, Run, PadRun
from .version import __version__


def compile_plan(src, dst, **kwargs):
    """Compile the plan between two layouts (see layoutlang.compiler.compile_plan)."""
    from layoutlang.compiler import compile_plan as compile_

    return compile_(src, dst, **kwargs)


__all__ = ["load", "loads", "compile_plan", "Layout", "Mesh", "Axis", "TensorIR", "DimIR", "Run", "PadRun",
           "LayoutError", "ParseError", "ElaborationError", "UsageError", "__version__"]
