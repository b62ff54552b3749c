"""An op's slice of a local tensor as a torch view: plain, stepped or strided blocks.

A slice holds one entry per dim (compiler/strides.py, LANGUAGE.md 6):
`(start, stop)`, `(start, stop, step)` or `(start, stop, step, block)`. The view
has one torch dim per plain or stepped entry and two (count, block) per
blocked entry; `shape(slice)` is the receiver's shape of it, which every op's
source block is reshaped to. No copy, no Python loop over rows: one
`as_strided` over the tensor's storage.
"""

from __future__ import annotations

import torch

from layoutlang.compiler.strides import parts


def shape(sl) -> list[int]:
    """The view's shape: per dim its extent, or (count, block) for a blocked entry."""
    out = []
    for e in sl:
        if len(e) == 4:
            _, count, _, block = parts(e)
            out += [count, block]
        elif len(e) == 3:
            out.append(parts(e)[1])
        else:
            out.append(e[1] - e[0])
    return out


def view(tensor: torch.Tensor, sl) -> torch.Tensor:
    """tensor[sl] as a view (sharing storage: writes land in `tensor`)."""
    if all(len(e) == 2 for e in sl):
        return tensor[tuple(slice(a, b) for a, b in sl)]
    offset, sizes, strides_ = tensor.storage_offset(), [], []
    for e, stride in zip(sl, tensor.stride()):
        start, count, step, block = parts(e)
        offset += start * stride
        if len(e) == 4:
            sizes += [count, block]
            strides_ += [step * stride, stride]
        elif len(e) == 3:
            sizes.append(count)
            strides_.append(step * stride)
        else:
            sizes.append(e[1] - e[0])
            strides_.append(stride)
    return tensor.as_strided(sizes, strides_, offset)
