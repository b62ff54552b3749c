"""Tiny vLLM models on CPU, for tests run under `.venv-vllm/bin/python` (scripts/setup_vllm.sh).

Not a test module: a helper that builds vLLM 0.33's own model classes (Llama, Qwen3-MoE,
DeepSeek-V3 with MLA) from a tiny HF config written to a temporary folder, in a process
whose torch.distributed world is set up on gloo by vLLM's own
`init_distributed_environment` / `ensure_model_parallel_initialized`, and feeds them a
random transformers state dict through vLLM's own `model.load_weights`.

    import vllm_models as vm                         # tests/ on sys.path, as under pytest
    vm.setup_env()                                   # before anything imports vllm
    vc, model = vm.build(vm.LLAMA, tmpdir)           # vLLM's get_model, load_format="dummy"
    sd = vm.hf_state_dict(vm.LLAMA)                  # checkpoint names (per-expert for MoE)
    vm.load_hf_weights(model, sd, vc)                # layerwise reload + model.load_weights
    _, m = vm.build(vm.QWEN3_MOE, d, direct=True)    # constructed, nothing post-processed
    vm.load_hf_weights(m, sd_moe)                    # plain model.load_weights
    with vm.fake_tp(1, 2):                           # TP rank 1 of 2 in a 1-process world
        _, m1 = vm.build(vm.LLAMA, d2, direct=True)
        vm.load_hf_weights(m1, sd)
    llm = vm.make_llm(vm.LLAMA, d3, weight_transfer_config={"backend": "mine"})

What the PyPI wheel of vLLM 0.33 lacks on CPU: it is the CUDA build, so `vllm._C` (the
CPU kernels, `torch.ops._C.*`) is not there. Building a model, and a `vllm.LLM`, looks up
only three of those ops; `install_cpu_op_shims()` defines them in the `_C` namespace
(`silu_and_mul` in plain torch, `prepack_moe_weight` as an identity copy where vLLM's
kernel would reorder MoE weights into its blocked layout, `init_cpu_memory_env` as a
no-op). Building and loading weights work; a forward pass through vLLM's CPU attention does
not (its kernels are missing). torch 2.13's `torch.accelerator.empty_cache/synchronize`
raise without an accelerator where vLLM 0.33 (built for torch 2.14) calls them
unguarded: `cpu_accelerator_noops()`.

Importing this module imports neither vLLM nor transformers and changes no environment
variable (the main venv's pytest imports every module under tests/ for doctests); the
functions import them lazily, after `setup_env()`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

# Tiny configs: vocab_size 100 is deliberately not a multiple of vLLM's vocab padding (64),
# so tests see the padded rows of embed_tokens / lm_head.
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    # every MLA dim distinct, so a transposed W_UK_T / W_UV cannot pass a shape check
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

ARCHS: dict[str, dict[str, Any]] = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}


def setup_env() -> None:
    """VLLM_TARGET_DEVICE=cpu and offline HF, unless already set. Must run before the
    first `import vllm` of the process (vLLM resolves its platform once): scripts that
    import vllm themselves call this first, or export the variables."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --- the ops vLLM's CUDA wheel does not have on CPU --------------------------------------

_SHIM_LIB: Any = None


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def _prepack_moe_weight(weight: torch.Tensor, output: torch.Tensor, isa: str) -> None:
    # vLLM's real CPU kernel reorders each expert matrix into the blocked layout its grouped
    # GEMM reads (same shape, other element order); this stand-in keeps the loaded layout,
    # so tests read w13/w2 after process_weights_after_loading as load_weights wrote them.
    output.copy_(weight)


def _init_cpu_memory_env(nodes: list[int]) -> None:
    # CPUWorker.__init__ binds the worker's memory to its NUMA node(s); nothing to do here
    return None


# name -> (schema, implementation, dispatch key); only ops that are missing get defined
_SHIMS = {
    "silu_and_mul": ("silu_and_mul(Tensor! out, Tensor input) -> ()", _silu_and_mul, "CPU"),
    "prepack_moe_weight": (
        "prepack_moe_weight(Tensor weight, Tensor! output, str isa) -> ()",
        _prepack_moe_weight,
        "CPU",
    ),
    # no tensor argument to dispatch on, hence the composite key
    "init_cpu_memory_env": ("init_cpu_memory_env(int[] nodes) -> ()", _init_cpu_memory_env, "CompositeExplicitAutograd"),
}


def install_cpu_op_shims() -> list[str]:
    """Define the `torch.ops._C.*` ops that building a vLLM model looks up, where vLLM's own
    CPU kernels (`vllm._C`) are absent. Idempotent; returns the names it defined."""
    global _SHIM_LIB
    defined = []
    for name, (schema, impl, key) in _SHIMS.items():
        if hasattr(torch.ops._C, name):
            continue
        if _SHIM_LIB is None:
            _SHIM_LIB = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901 (kept alive)
        _SHIM_LIB.define(schema)
        _SHIM_LIB.impl(name, impl, key)
        defined.append(name)
    return defined


@contextlib.contextmanager
def cpu_accelerator_noops() -> Iterator[None]:
    """Make `torch.accelerator.empty_cache` / `synchronize` no-ops while no accelerator
    exists. vLLM 0.33 calls them unguarded (the model loader after loading weights,
    `WeightTransferEngine.update_weights` after `receive_weights`); on the CPU build of
    torch 2.13 both raise "Cannot access accelerator device when none is available"."""
    from unittest import mock

    if torch.accelerator.is_available():
        yield
        return
    with mock.patch.object(torch.accelerator, "empty_cache", lambda: None), mock.patch.object(
        torch.accelerator, "synchronize", lambda device=None: None
    ):
        yield


# --- distributed world --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(vllm_config: Any, rank: int = 0, init_method: str | None = None) -> None:
    """vLLM's own world + model-parallel groups on gloo, sized by `vllm_config.parallel_config`
    (world_size 1 by default). Idempotent within a process."""
    setup_env()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    pc = vllm_config.parallel_config
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            pc.world_size, rank, init_method or f"tcp://127.0.0.1:{_free_port()}", rank, "gloo"
        )
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)


# --- configs and models -------------------------------------------------------------------


def write_config(arch_config: Mapping[str, Any], tmpdir: str | os.PathLike) -> Path:
    """config.json of `arch_config` in `tmpdir` (a model folder without weights)."""
    path = Path(tmpdir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(arch_config), indent=1))
    return path


def make_vllm_config(model_dir: str | os.PathLike, **engine_args: Any) -> Any:
    """VllmConfig through vLLM's EngineArgs: no tokenizer, dummy weights, eager, float32."""
    setup_env()
    from vllm.engine.arg_utils import EngineArgs

    kw: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        tensor_parallel_size=1,
    )
    kw.update(mla_backend(json.loads((Path(model_dir) / "config.json").read_text())))
    kw.update(engine_args)
    return EngineArgs(**kw).create_engine_config()


def mla_backend(arch_config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine args that pin an MLA model (DeepSeek-V3's `kv_lora_rank`) to vLLM's reference
    CPU MLA backend. vLLM 0.33 prefers AMX_MLA wherever the CPU has AMX tiles, and AMX_MLA's
    `process_weights_after_loading` calls `torch.ops._C.convert_weight_packed`, a kernel of the
    compiled `vllm._C` this CPU install lacks: without the pin the build depends on the host's
    CPU (it failed on CI's AMX machine)."""
    return {"attention_backend": "CPU_MLA"} if arch_config.get("kv_lora_rank") else {}


def build(
    arch_config: Mapping[str, Any], tmpdir: str | os.PathLike, *, direct: bool = False,
    parallel: Mapping[str, Any] | None = None, **engine_args: Any,
) -> tuple[Any, torch.nn.Module]:
    """(vllm_config, model) of `arch_config` on CPU at TP1 (or what `engine_args` set).

    `direct=False` builds through vLLM's model loader (`get_model`, load_format "dummy":
    random weights, then `process_weights_after_loading`); `direct=True` constructs the model
    class under `set_current_vllm_config` without the loader (no dummy fill, no
    post-processing). `parallel`: ParallelConfig fields set after vLLM validated the config,
    before the model is built (EPLB: vLLM refuses `enable_eplb` off CUDA, the model classes
    read it and `eplb_config.num_redundant_experts` at construction)."""
    setup_env()
    install_cpu_op_shims()
    vllm_config = make_vllm_config(write_config(arch_config, tmpdir), **engine_args)
    for name, value in (parallel or {}).items():
        target = vllm_config.parallel_config
        *path, last = name.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    init_distributed(vllm_config)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), cpu_accelerator_noops():
        if direct:
            # what the loader does before loading weights: construct under the config's
            # dtype and device, and record the metadata layerwise reload restores from
            from vllm.model_executor.model_loader.utils import initialize_model
            from vllm.utils.torch_utils import set_default_torch_dtype

            with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
        else:
            from vllm.model_executor.model_loader import get_model

            model = get_model(vllm_config=vllm_config)
    return vllm_config, model


def make_llm(arch_config: Mapping[str, Any], tmpdir: str | os.PathLike, **llm_args: Any) -> Any:
    """A whole `vllm.LLM` on CPU, engine core and worker in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, so engines registered with
    `WeightTransferEngineFactory` here are seen by the worker), dummy weights. Pass
    `weight_transfer_config={"backend": NAME}` to get a weight-transfer engine built by the
    worker's `load_model`; drive it with `llm.init_weight_transfer_engine({"init_info":
    ...})`, `start_weight_update()`, `update_weights({"update_info": ...})`,
    `finish_weight_update()`, and inspect the worker with `llm.collective_rpc(fn)`
    (`fn(worker)`). Call it, and use the LLM, inside `cpu_accelerator_noops()`.

    Building works (about 40 s of it is vLLM's warm-up); `generate` does not: CPU attention
    needs vLLM's missing CPU kernels (`torch.ops._C.compute_slot_mapping_kernel_impl` is the
    first). vLLM's shutdown at exit calls `torch.accelerator.synchronize` and logs an
    error there."""
    setup_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    install_cpu_op_shims()
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=str(write_config(arch_config, tmpdir)),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        enforce_eager=True,
    )
    kw.update(mla_backend(arch_config))
    kw.update(llm_args)
    return LLM(**kw)


def hf_model(arch_config: Mapping[str, Any], seed: int = 0) -> torch.nn.Module:
    """A random transformers model of the same config (float32, CPU)."""
    setup_env()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(arch_config)
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_config leaves some tensors (norms, biases) at constants: make every tensor random
    # so a wrong mapping cannot pass by accident
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.eval()


def hf_state_dict(arch_config: Mapping[str, Any], seed: int = 0, tmpdir: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """State dict of a random transformers model in *checkpoint* format (the names and
    shapes `save_pretrained` writes: per-expert `mlp.experts.E.gate_proj.weight`, which is
    what vLLM's `load_weights` expects), read back with safetensors."""
    import tempfile

    from safetensors.torch import load_file

    model = hf_model(arch_config, seed)
    with contextlib.ExitStack() as stack:
        out = Path(tmpdir) if tmpdir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model.save_pretrained(out, safe_serialization=True)
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("*.safetensors")):
            sd.update(load_file(str(f)))
    return sd


def load_hf_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], vllm_config: Any = None) -> set[str]:
    """vLLM's own `model.load_weights(iter)` over `state_dict` (copied, so vLLM's in-place
    loaders cannot alias the caller's tensors). Returns the names load_weights reports.

    Without `vllm_config`: load_weights alone, for a model from `build(direct=True)`
    (nothing post-processed). With it: the way vLLM's weight-transfer engines reload a
    loader-built (already post-processed) model, `initialize_layerwise_reload` ->
    load_weights -> `finalize_layerwise_reload`, which re-runs each layer's
    process_weights_after_loading on the new checkpoint tensors and copies the result
    into the existing parameter storage."""
    setup_env()
    items = ((k, v.clone()) for k, v in state_dict.items())
    with torch.no_grad(), cpu_accelerator_noops():
        if vllm_config is None:
            loaded = model.load_weights(items)
        else:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            with set_current_vllm_config(vllm_config):
                initialize_layerwise_reload(model)
                loaded = model.load_weights(items)
                finalize_layerwise_reload(model, vllm_config.model_config)
    return set(loaded) if loaded is not None else set()


def param_table(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, tuple[int, ...]]]:
    """(name, shape, dtype, stride) of every `named_parameters()` entry."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), tuple(p.stride())) for n, p in model.named_parameters()]


_FAKE_TP: list[tuple[int, int]] = []  # (rank, world_size) of the innermost fake_tp


def _fake_tp_rank() -> int:
    from vllm.distributed import parallel_state

    return _FAKE_TP[-1][0] if _FAKE_TP else parallel_state.get_tp_group().rank_in_group


def _fake_tp_world_size() -> int:
    from vllm.distributed import parallel_state

    return _FAKE_TP[-1][1] if _FAKE_TP else parallel_state.get_tp_group().world_size


@contextlib.contextmanager
def fake_tp(rank: int, world_size: int) -> Iterator[None]:
    """Make vLLM's layers believe they are TP rank `rank` of `world_size` in a 1-process
    world, the way vLLM's own unit tests patch it: the functions that parallel layers and
    weight loaders call (`get_tensor_model_parallel_rank/world_size`, and the TP group's
    `rank_in_group` / `world_size`) are patched in every `vllm.*` module that imported them.
    The real world must exist first (`init_distributed`, or one `build` outside).

    Modules first imported inside the block bind the stand-ins for good; outside any
    fake_tp the stand-ins answer what the real TP group says, so that is harmless."""
    import sys
    from unittest import mock

    from vllm.distributed import parallel_state

    stand_ins = {
        "get_tensor_model_parallel_rank": _fake_tp_rank,
        "get_tensor_model_parallel_world_size": _fake_tp_world_size,
    }
    originals = {n: getattr(parallel_state, n) for n in stand_ins}
    _FAKE_TP.append((rank, world_size))
    try:
        with contextlib.ExitStack() as stack:
            for mod in list(sys.modules.values()):
                if mod is None or not getattr(mod, "__name__", "").startswith("vllm"):
                    continue
                for n, fake in stand_ins.items():
                    if getattr(mod, n, None) is originals[n]:
                        stack.enter_context(mock.patch.object(mod, n, fake))
            tp = parallel_state.get_tp_group()
            stack.enter_context(mock.patch.object(tp, "rank_in_group", rank))
            stack.enter_context(mock.patch.object(tp, "world_size", world_size))
            yield
    finally:
        _FAKE_TP.pop()


def copy_config(arch_config: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of `arch_config` with `changes` applied."""
    cfg = copy.deepcopy(dict(arch_config))
    cfg.update(changes)
    return cfg
