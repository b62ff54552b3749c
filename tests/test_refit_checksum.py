"""`verify=True` catches two swapped elements (layoutlang/runtime/refit.py `_checksum`'s promise).

The checksum is five position-weighted sums (sum d weights a position by its digit d
in base 251, plus one: 1, 2, ..., 251, 1, 2, ... for d = 0): a sum without the weights
is blind to any permutation, one weight alone to elements 251 apart. Expected values are computed here
by hand from that written rule; then two gloo processes refit with `verify=True`
while a hook (RefitHooks.on_send, the runtime's documented test seam) swaps two
elements of what rank 0 sends: adjacent ones, the first and the last, two rows.
Each swapped step must fail verification on both ranks naming the op; the clean
steps before and after must pass, every element exact.
"""

from __future__ import annotations

import pytest

SRC = "mesh s (r=1)\ntensor w [4, 8] fp32\n"
DST = "mesh d (r=1) at 1\ntensor w [4, 8] fp32\n"
# step -> the flat positions (or rows, for "rows") swapped in rank 0's send buffer; None: clean
SWAPS = {1: None, 2: (0, 1), 3: (0, 31), 4: ("rows", 0, 1), 5: None}


def test_the_checksum_weights_positions():
    import torch

    from layoutlang.runtime.refit import _checksum

    # sum of value x (position % 251 + 1), by hand
    assert _checksum(torch.tensor([1.0, 2.0, 3.0]))[0].item() == 1 * 1 + 2 * 2 + 3 * 3        # 14
    assert _checksum(torch.tensor([2.0, 1.0, 3.0]))[0].item() == 2 * 1 + 1 * 2 + 3 * 3        # 13: a swap shows
    assert _checksum(torch.tensor([3.0, 2.0, 1.0]))[0].item() == 3 * 1 + 2 * 2 + 1 * 3        # 10
    assert _checksum(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))[0].item() == 1 + 4 + 9 + 16      # C order
    assert _checksum(torch.tensor([[3.0, 4.0], [1.0, 2.0]]))[0].item() == 3 + 8 + 3 + 8       # rows swapped: 22
    x = torch.zeros(253)
    x[250], x[251], x[252] = 5.0, 7.0, 11.0  # weights 251, then 1, 2 again
    assert _checksum(x)[0].item() == 5 * 251 + 7 * 1 + 11 * 2
    # the second sum weights by position // 251 (+1): 250 -> 1, 251 and 252 -> 2
    assert _checksum(x)[1].item() == 5 * 1 + 7 * 2 + 11 * 2
    # the higher digits are all 0 here: weight 1, the plain sum
    assert _checksum(x)[2:].tolist() == [23.0, 23.0, 23.0]
    assert _checksum(x).dtype == torch.float64 and _checksum(x).shape == (5,)


def test_a_swap_of_elements_251_apart_shows():
    import torch

    from layoutlang.runtime.refit import _checksum

    # two rows of a [3, 251] tensor: every element's partner is 251 positions away, where
    # position % 251 is the same; the second digit (position // 251) tells them apart
    x = torch.arange(3 * 251, dtype=torch.float32).reshape(3, 251)
    swapped = x[[1, 0, 2]]
    assert _checksum(x)[0].item() == _checksum(swapped)[0].item()      # the first sum alone is blind
    # by hand, the second sum:
    # rows weigh 1, 2, 3; row sums are s0 = sum(0..250), s1 = s0 + 251*251, s2 = s0 + 2*251*251
    s0 = sum(range(251))
    s1, s2 = s0 + 251 * 251, s0 + 2 * 251 * 251
    assert _checksum(x)[1].item() == 1 * s0 + 2 * s1 + 3 * s2
    assert _checksum(swapped)[1].item() == 1 * s1 + 2 * s0 + 3 * s2
    far = torch.zeros(251 * 251 + 1)
    far[0], far[251 * 251] = 1.0, 2.0                                    # 63001 apart: the third digit
    moved = far.flip(0)
    assert not torch.equal(_checksum(far), _checksum(moved))


def _body(job: dict, rank: int) -> dict:
    import torch

    from layoutlang import compile_plan, loads
    from layoutlang.runtime import Refitter
    from layoutlang.runtime.errors import RefitError
    from layoutlang.runtime.refit import RefitHooks

    class Swap(RefitHooks):
        step = 0

        def before_refit(self, refitter, step):
            self.step = step

        def on_send(self, buf, op):
            swap = SWAPS[self.step]
            if swap is None:
                return buf
            buf = buf.clone()
            if swap[0] == "rows":
                buf[[swap[1], swap[2]]] = buf[[swap[2], swap[1]]]
            else:
                flat = buf.reshape(-1)
                flat[[swap[0], swap[1]]] = flat[[swap[1], swap[0]]]
            return buf

    refitter = Refitter(compile_plan(loads(SRC), loads(DST)), verify=True, hooks=Swap(), timeout=30)
    out = {}
    for step in SWAPS:
        want = torch.arange(32, dtype=torch.float32).reshape(4, 8) + 1 + 100 * step
        src = {"w": want.clone()} if rank == 0 else None
        dst = {"w": torch.full((4, 8), -1.0)} if rank == 1 else None
        try:
            refitter.refit(src, dst)
            error = None
        except RefitError as e:
            error = e.message
        out[str(step)] = {"error": error, "exact": None if dst is None else torch.equal(dst["w"], want)}
    return out


@pytest.mark.timeout(60)
def test_verify_fails_every_step_whose_send_swapped_two_elements():
    from layoutlang.runtime.launch import launch

    results = launch({}, 2, timeout=50, program=__file__)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {(r.result or {}).get('trace', '')[-2000:]}"
        for step, swap in SWAPS.items():
            got = r.result[str(step)]
            if swap is None:
                assert got["error"] is None, (r.rank, step, got)
                assert got["exact"] in (None, True), (r.rank, step, got)
            else:
                assert got["error"] is not None, f"rank {r.rank}, step {step}: swap {swap} passed verify=True"
                assert got["error"].startswith(f"rank {r.rank}: step {step}, verification: verification failed: "
                                               "destination contents differ from the source: "), got["error"]
                assert "`w` (w[0:4, 0:8] on rank 1, from rank 0, op 0)" in got["error"], got["error"]
                assert got["exact"] in (None, False), (r.rank, step, got)  # the swap did land
    assert [r.result["1"]["exact"] for r in results] == [None, True]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bridge_program import run

    run(_body)
