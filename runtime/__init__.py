"""The refit runtime: executes a compiled plan on torch.distributed.

>>> from layoutlang.runtime import Refitter  # doctest: +SKIP
>>> Refitter(plan, verify=True).refit(src_tensors, dst_tensors)  # doctest: +SKIP
"""

import warnings

# torch warns once at import when NumPy is absent; layoutlang never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from .errors import RefitError
from .quant import Fp8BlockTensor, Fp8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor, dequantize, quantize
from .refit import Refitter, RefitHooks

__all__ = ["Refitter", "RefitError", "RefitHooks", "Fp8Tensor", "MXFP8Tensor", "Fp8BlockTensor", "MXFP4Tensor",
           "NVFP4Tensor", "quantize", "dequantize"]
