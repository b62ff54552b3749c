"""layoutlang: describe how every weight is sharded; move weights between layouts.

>>> from layoutlang import loads
>>> layout = loads("mesh m (tp=2)\\ntensor w [8 over tp, 4]")
>>> [t.local_shape for t in layout.tensors]
[(4, 4)]
"""

from .diagnostics import LayoutError, ParseError, ElaborationError, UsageError
from .elaborate import load, loads
from .ir import Layout, Mesh, Axis, TensorIR, DimIR, Run, PadRun

__version__ = "0.1.0"

__all__ = ["load", "loads", "Layout", "Mesh", "Axis", "TensorIR", "DimIR", "Run", "PadRun",
           "LayoutError", "ParseError", "ElaborationError", "UsageError", "__version__"]
