"""The refit runtime: executes a compiled plan on torch.distributed.

>>> from layoutlang.runtime import Refitter  # doctest: +SKIP
>>> Refitter(plan, verify=True).refit(src_tensors, dst_tensors)  # doctest: +SKIP
"""

from .quant import Fp8Tensor, MXFP8Tensor, dequantize, quantize
from .refit import Refitter, RefitError

__all__ = ["Refitter", "RefitError", "Fp8Tensor", "MXFP8Tensor", "quantize", "dequantize"]
