"""Transports on a GPU host: CUDA IPC ("memory") and NCCL ("group") against a device copy (issue 50).

    .venv/bin/python benchmarks/gpu_transports.py            # on a GPU machine: 1 GiB a refit
    .venv/bin/python benchmarks/gpu_transports.py --small    # 64 MiB
    .venv/bin/python benchmarks/gpu_transports.py --check    # without a GPU: says so, exits 0

The case of benchmarks/transports.py (2 trainer ranks TP2 -> 2 engine ranks, every piece
contiguous, bf16) with every rank's tensors on a GPU (rank % device count): with one GPU the
four processes share it, as a colocated RL job's trainer and engine do, and only "memory"
(CUDA IPC handles between the processes) runs; NCCL refuses two ranks on one device, so
"group" runs only with a GPU per rank. The floor is each receiving rank's
`torch.Tensor.copy_` of the bytes it receives, device to device. Ratios are paired per round
with their 95 % interval, each method's result checked element by element (exit 1 if wrong).
No target is stated: no figure has been measured on a GPU yet. Without a GPU the script
prints why it did nothing and exits 0 (CI runs it that way: tests/test_benchmarks_and_docs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--check", action="store_true", help="only say whether a GPU is here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_transports: no CUDA device here (torch.cuda.is_available() is False): nothing run")
        return 0
    if args.check:
        print(f"gpu_transports: {torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name(0)}")
        return 0
    import transports

    extra = ["--small"] if args.small else []
    if args.rounds:
        extra += ["--rounds", str(args.rounds)]
    return transports.main([*extra, "--methods", "floor,memory,group", "--device", "cuda"])


if __name__ == "__main__":
    sys.exit(main())
