"""The SGLang `--custom-weight-loader` (layoutlang.integrations.sglang), without SGLang.

SGLang 0.5.23 does not import on these machines, so what SGLang does around the loader is
played by tests/sglang_program.py (every TP worker runs the loader with the named tensors of
one `update_weights_from_tensor` call; the call returns when all have) and the workers'
models are built there by hand with SGLang's parameter names and each rank's slices, written
out from SGLang's storage rules (not from the layout). Untested here: SGLang's own
serialization of the message tensor, its parallel state (`_parallel`), its post-load
processing on real hardware (docs/engines.md).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from layoutlang.integrations import sglang
from layoutlang.integrations.live import EngineRefused

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import program_runs  # noqa: E402
import sglang_program as sp  # noqa: E402

PROGRAM = ROOT / "tests" / "sglang_program.py"
TIMEOUT = 120


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_all(*commands: list[str]) -> list[list[dict]]:
    """Every command at once, one deadline (program_runs.py); each one's JSON lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return program_runs.run_all(sys.executable, PROGRAM, list(commands), env=env, cwd=ROOT, timeout=TIMEOUT)


@pytest.mark.parametrize("arch, tp", [("llama", 2), ("llama", 4), ("qwen3_moe", 2)])
def test_three_refits_through_the_custom_loader(arch, tp):
    """TP workers joined by an `init` message, three `update`s with new weights between, a
    `close`: after each update every parameter equals the step's HF tensors sliced by SGLang's
    rules (KV heads replicated at TP4, FusedMoE's w13 = each expert's gate|up rows of the rank),
    padding rows zero (LANGUAGE.md 3), no parameter's storage moved."""
    port, ctrl = _ports(2)
    trainer, *engines = run_all(["trainer", arch, str(port), str(ctrl), str(tp)],
                                *(["engine", arch, str(port), str(ctrl), str(tp), str(r)] for r in range(tp)))
    assert [x["replicas"] for x in trainer if "step" in x] == [[sp.REPLICA]] * 3
    assert trainer[-1]["messages"] == 1 + 3 + 1
    for lines in engines:
        steps = [x for x in lines if "step" in x]
        assert [x["version"] for x in steps] == [1, 2, 3]
        assert all(x["differ"] == [] and x["moved"] == [] for x in steps)
        assert lines[-1]["kinds"] == ["layoutlang.init"] + ["layoutlang.update"] * 3 + ["layoutlang.close"]
        assert lines[-1]["workers"] == 0  # `close` left the job
    if (arch, tp) == ("llama", 2):
        # by hand: embed and lm_head 64x64 (100 padded to 128, halved), norm 64; per layer qkv 64x64
        # (2 q + 1 k + 1 v heads of 16), o 64x32, gate_up 128x64, down 64x64, two norms 64
        assert {lines[-1]["elements"] for lines in engines} == {2 * 4096 + 64 + 2 * (4096 + 2048 + 8192 + 4096 + 128)}


def _refusal(model, rank=0, tp=2) -> str:
    """The message of the EngineRefused an init on `model` raises (the address is a closed port:
    a refusal has to come before any connection)."""
    (closed,) = _ports(1)
    saved = sglang._parallel
    sglang._parallel = lambda: (rank, tp, 1)
    try:
        with pytest.raises(EngineRefused) as err:
            sglang.load_weights(model, sglang.message("init", address=f"127.0.0.1:{closed}", timeout=2.0,
                                                      connect_timeout=1.0))
    finally:
        sglang._parallel = saved
    assert model not in sglang._WORKERS
    return str(err.value)


def test_a_misshapen_parameter_is_refused_naming_it():
    model = sp.sglang_model(sp.LLAMA, 0, 2)
    mlp = getattr(model.model.layers, "0").mlp
    mlp.gate_up_proj.weight = torch.nn.Parameter(torch.zeros(192, 64), requires_grad=False)
    text = _refusal(model)
    assert "SGLang worker 0: the live model is not the layout it would be refit as, nothing was moved" in text
    assert ("`model.layers.0.mlp.gate_up_proj.weight`: the layout says [128, 64] fp32, SGLang holds [192, 64] "
            "float32") in text


def test_a_missing_or_extra_parameter_is_refused():
    model = sp.sglang_model(sp.LLAMA, 1, 2)
    layer = getattr(model.model.layers, "1")
    del layer.self_attn.o_proj.weight
    layer.self_attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    text = _refusal(model, rank=1)
    assert "layout tensor `model.layers.1.self_attn.o_proj.weight` is not a parameter of the live model" in text
    assert "live parameter `model.layers.1.self_attn.extra` [3] is not in the layout: a refit would leave it stale" \
        in text


class Fp8LinearMethod:  # stands for a quantization method that stores kernel-format weights
    pass


class UnquantizedLinearMethod:  # SGLang's name: direct on a GPU, repacked (AMX) on its CPU backend
    pass


def test_kernel_format_storage_is_refused_naming_the_module():
    model = sp.sglang_model(sp.LLAMA, 0, 2)
    layer = getattr(model.model.layers, "0")
    layer.self_attn.qkv_proj.quant_method = Fp8LinearMethod()
    layer.mlp.down_proj.quant_method = UnquantizedLinearMethod()
    text = _refusal(model)
    assert ("`model.layers.0.self_attn.qkv_proj`: quantization method Fp8LinearMethod stores kernel-format "
            "weights that no layout here describes") in text
    assert "`model.layers.0.mlp.down_proj`: SGLang's CPU backend repacks UnquantizedLinearMethod weights (AMX)" in text


def test_messages_that_are_not_layoutlangs_are_refused():
    model = sp.sglang_model(sp.LLAMA, 0, 2)
    with pytest.raises(EngineRefused, match=r"got tensors \[model.norm.weight\], not one layoutlang message"):
        sglang.load_weights(model, [("model.norm.weight", torch.zeros(64))])
    with pytest.raises(EngineRefused, match=r"`layoutlang.update` before `layoutlang.init` on this worker"):
        sglang.load_weights(model, sglang.message("update", version=1))
    with pytest.raises(EngineRefused, match=r"`layoutlang.init`: not JSON"):
        sglang.load_weights(model, [("layoutlang.init", torch.tensor([0xFF, 0x00], dtype=torch.uint8))])
    with pytest.raises(EngineRefused, match=r"expected a JSON object, got list"):
        sglang.read_message([("layoutlang.init", torch.frombuffer(bytearray(b"[1]"), dtype=torch.uint8))])
