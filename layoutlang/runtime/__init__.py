"""The refit runtime: executes a compiled plan on torch.distributed.

Inside one world the caller built, `Refitter` (docs/runtime.md):

>>> from layoutlang.runtime import Refitter  # doctest: +SKIP
>>> Refitter(plan, verify=True).refit(src_tensors, dst_tensors)  # doctest: +SKIP

Between separately launched jobs, a trainer job and engine replicas that come and go,
`TrainerJob` and `EngineJob` (docs/jobs.md):

>>> job = TrainerJob("train.layout", "infer.layout", address="host:port", rank=r, world_size=N)  # doctest: +SKIP
>>> job.refit(trainer_tensors, version=step).missed  # doctest: +SKIP
>>> EngineJob("infer.layout", address="host:port", replica="r0", rank=t, world_size=TP).receive(tensors)  # doctest: +SKIP
"""

import warnings

# torch warns once at import when NumPy is absent; layoutlang never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from .errors import RefitError
from .quant import Fp8BlockTensor, Fp8Tensor, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor, dequantize, quantize
from .refit import Refitter, RefitHooks
from .jobs import EngineJob, JobReport, TrainerJob

__all__ = ["Refitter", "TrainerJob", "EngineJob", "JobReport", "RefitError", "RefitHooks", "Fp8Tensor",
           "MXFP8Tensor", "Fp8BlockTensor", "MXFP4Tensor", "NVFP4Tensor", "quantize", "dequantize"]
