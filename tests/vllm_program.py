"""The vLLM backend end to end, run under .venv-vllm/bin/python by tests/test_vllm.py.

    vllm_program.py engine ARCH PORT [TP RANK]  # a vLLM worker (its own gloo world) + the backend
    vllm_program.py trainer ARCH PORT [TP]      # a trainer job (TrainerJob, 1 rank) in another process
    vllm_program.py driven PORT          # vLLM's trainer factory drives an in-process LLM (tiny Llama)
    vllm_program.py refused              # every refused case, before a byte moves
    vllm_program.py llm PORT             # a whole vllm.LLM as the trainer factory's client
    vllm_program.py placement            # uneven and round-robin experts refused
    vllm_program.py eplb_engine PORT RANK  # rank RANK of an EPLB replica (EP faked at 2), maps rebalanced
    vllm_program.py eplb_trainer PORT      # the trainer job feeding it
    vllm_program.py plugin               # vLLM's plugin loader registers the backend

`engine` builds ARCH (tests/vllm_models.py: tiny Llama, Qwen3-MoE, DeepSeek-V3 with MLA)
through vLLM's model loader, creates the backend through vLLM's WeightTransferEngineFactory
with a real VllmConfig, then runs vLLM's update flow three times (init_transfer_engine, then
start_weight_update / update_weights / finish_weight_update). After each, it checks every
live parameter and buffer against an oracle model of the same config that vLLM's own
`load_weights` (inside vLLM's layerwise reload, as its nccl backend does) filled from the
trainer's checkpoint of that step: the HF checkpoint of seed STEP, which the trainer process
sends. Every line printed is JSON; the last is {"ok": true, ...} or the program exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_models as vm  # noqa: E402

vm.setup_env()
import torch  # noqa: E402

STEPS = 3
# the CPU MoE backend pads each rank's expert width to a multiple of 32, and vLLM's own layerwise
# reload then fails (a kernel tensor of the padded width, a processed one of the loaded width:
# vLLM 0.33 on CPU): at TP2 the experts are 64 wide, 32 per rank, so nothing is padded
ARCHS = dict(vm.ARCHS, qwen3_moe_wide=vm.copy_config(vm.QWEN3_MOE, moe_intermediate_size=64),
             qwen3_moe_ep=vm.QWEN3_MOE)
ENGINE_ARGS = {"qwen3_moe_ep": {"enable_expert_parallel": True}}  # experts whole, over the TP ranks
REPLICA = "vllm-0"
TIMEOUT = 60.0


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def engine_text(cfg, tp: int = 1, ep: int = 1) -> str:
    from layoutlang.integrations.vllm import engine_layout
    return engine_layout(cfg, dtype="float32", tp=tp, ep=ep)


def hf_text(cfg) -> str:
    from layoutlang.bridges.families import model_from_config, render
    return render(model_from_config(cfg), "hf", {"DP": 1, "AT": 0})


def checkpoint(cfg, step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at `step`: a random HF model of seed `step`, checkpoint names."""
    return vm.hf_state_dict(cfg, seed=step)


def differences(model, oracle) -> list[str]:
    """Every parameter and buffer of `model` that is not exactly the oracle's."""
    mine = dict(model.named_parameters()) | dict(model.named_buffers())
    theirs = dict(oracle.named_parameters()) | dict(oracle.named_buffers())
    out = sorted(set(mine) ^ set(theirs))
    for name, t in mine.items():
        o = theirs.get(name)
        if o is not None and (t.shape != o.shape or t.dtype != o.dtype or not torch.equal(t, o)):
            out.append(name)
    return out


def make_engine(vc, model):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from layoutlang.integrations.vllm import register
    register()
    register()  # a second registration (the plugin loaded twice) is not an error
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="layoutlang"), vc,
                                                     torch.device("cpu"), model)


def run_engine(arch: str, port: int, tp: int = 1, rank: int = 0) -> None:
    """One worker; with `tp` > 1 it is TP rank `rank` of a replica of `tp` processes, faked the
    way vLLM's own tests do (tests/vllm_models.fake_tp: vLLM's world is this one process)."""
    import contextlib

    cfg = ARCHS[arch]
    tmp = tempfile.mkdtemp()
    with contextlib.ExitStack() as stack:
        if tp > 1:
            vm.init_distributed(vm.make_vllm_config(vm.write_config(cfg, Path(tmp) / "world")))
            stack.enter_context(vm.fake_tp(rank, tp))
        extra = ENGINE_ARGS.get(arch, {})
        vc, model = vm.build(cfg, Path(tmp) / "engine", **extra)
        _, oracle = vm.build(cfg, Path(tmp) / "oracle", **extra)
        vc.parallel_config.tensor_parallel_size = tp
        refit_engine(arch, port, vc, model, oracle)


def refit_engine(arch: str, port: int, vc, model, oracle) -> None:
    from vllm.config import set_current_vllm_config

    cfg = ARCHS[arch]
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine = make_engine(vc, model)
    say(arch=arch, phase="built", params=len(before), elements=sum(p.numel() for p in model.parameters()))
    with set_current_vllm_config(vc), vm.cpu_accelerator_noops():
        engine.init_transfer_engine(engine.parse_init_info(
            {"address": f"127.0.0.1:{port}", "replica": REPLICA, "timeout": TIMEOUT}))
        routes = {"direct": len(engine.live.direct), "reload": sorted(engine.live.reload),
                  "derived": len(engine.live.derived)}
        say(arch=arch, phase="init", routes={k: (v if isinstance(v, int) else len(v)) for k, v in routes.items()})
        for step in range(1, STEPS + 1):
            engine.start_weight_update()
            engine.update_weights({"version": step})
            engine.finish_weight_update()
            vm.load_hf_weights(oracle, checkpoint(cfg, step), vc)
            diff = differences(model, oracle)
            moved = [n for n, p in model.named_parameters() if before.get(n) != p.data_ptr()]
            say(arch=arch, step=step, version=engine.version, differ=diff[:10], moved_storage=moved[:10])
            if diff or moved or engine.version != step:
                sys.exit(1)
        engine.shutdown()
    say(ok=True, arch=arch, routes={k: (v if isinstance(v, int) else len(v)) for k, v in routes.items()})


def run_trainer(arch: str, port: int, tp: int = 1) -> None:
    from layoutlang.elaborate import loads
    from layoutlang.runtime import TrainerJob

    cfg = ARCHS[arch]
    ep = tp if ENGINE_ARGS.get(arch, {}).get("enable_expert_parallel") else 1
    job = TrainerJob(loads(hf_text(cfg), "hf.layout"), loads(engine_text(cfg, tp, ep), "vllm-replica.layout"),
                     address=f"127.0.0.1:{port}", rank=0, world_size=1, timeout=TIMEOUT)
    for step in range(1, STEPS + 1):
        report = job.refit(checkpoint(cfg, step), step, expect=(REPLICA,))
        for _ in range(4 if step == 1 else 0):  # a whole vllm.LLM may take longer to start than one timeout
            if report.replicas:
                break
            report = job.refit(checkpoint(cfg, step), step, expect=(REPLICA,))
        say(role="trainer", step=step, replicas=list(report.replicas), missed=list(report.missed))
        if list(report.replicas) != [REPLICA]:
            sys.exit(1)
    job.close()
    say(ok=True, role="trainer")


def run_driven(port: int) -> None:
    """vLLM's trainer factory with an in-process `LLM` as its client (tests/vllm_hosts.py: vLLM's
    own LLM entry points, Worker methods and backend over one engine): trainer_init, then
    send_weights three times; the backend's LLMClient gives the LLM vLLM's request objects."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from layoutlang.integrations.vllm_engine import LayoutlangTrainerInitInfo, LLMClient

    import vllm_hosts

    cfg = vm.LLAMA
    tmp = tempfile.mkdtemp()
    host = vllm_hosts.EngineHost("llama", tmp)
    train = Path(tmp) / "hf.layout"
    train.write_text(hf_text(cfg))
    info = LayoutlangTrainerInitInfo(train=str(train), infer=engine_text(cfg), address=f"127.0.0.1:{port}",
                                     world_size=1, replica=REPLICA, timeout=TIMEOUT, rank=0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=host.llm())
    for step in range(1, STEPS + 1):
        report = trainer.send_weights(checkpoint(cfg, step), step)
        seen = host.check(step)
        say(role="driven", replicas=list(report.replicas), **seen)
        if seen["differ"] or seen["weight_version"] != str(step) or list(report.replicas) != [REPLICA]:
            sys.exit(1)
    trainer.shutdown()
    host.core.worker.weight_transfer_engine.shutdown()
    say(ok=True, role="driven", calls=host.core.calls, adapted=type(trainer.client).__name__ == LLMClient.__name__)


def run_refused() -> None:
    """Each refused case raises EngineRefused naming the parameter, before any connection:
    the address given is a port nobody listens on, so reaching the store would fail instead."""
    from vllm.config import set_current_vllm_config

    from layoutlang.integrations.vllm_engine import EngineRefused

    tmp = tempfile.mkdtemp()
    init = {"address": "127.0.0.1:9", "replica": REPLICA, "timeout": 5.0}
    cases = {}

    def attempt(name, vc, model, mutate=None):
        engine = make_engine(vc, model)
        if mutate:
            mutate(engine)
        try:
            with set_current_vllm_config(vc), vm.cpu_accelerator_noops():
                engine.init_transfer_engine(engine.parse_init_info(init))
        except EngineRefused as exc:
            cases[name] = str(exc)
        else:
            cases[name] = None

    vc, model = vm.build(vm.LLAMA, Path(tmp) / "llama")
    # the layout vLLM's config says is not the model it holds: a config with another MLP width
    other = vm.copy_config(vm.LLAMA, intermediate_size=96)
    vc_other = vm.make_vllm_config(vm.write_config(other, Path(tmp) / "other"))
    attempt("layout", vc_other, model)

    # a quantization method whose loaded format no layout describes
    class Fp8LinearMethod:  # the name is what the backend reads
        pass

    def fp8(engine):
        module = engine.model.get_submodule("model.layers.1.self_attn.o_proj")
        engine._saved = module.quant_method
        module.quant_method = Fp8LinearMethod()
    attempt("quantized", vc, model, fp8)
    model.get_submodule("model.layers.1.self_attn.o_proj").quant_method = \
        model.get_submodule("model.layers.0.self_attn.o_proj").quant_method

    # a parameter the layout does not cover (a refit would leave it stale)
    model.get_submodule("model.layers.0.mlp").register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    attempt("uncovered", vc, model)
    del model.get_submodule("model.layers.0.mlp").extra
    report(cases)


def report(cases: dict) -> None:
    for name, message in cases.items():
        say(case=name, message=message)
    say(ok=all(cases.values()), refused=sorted(k for k, v in cases.items() if v))


def run_placement() -> None:
    """vLLM's uneven linear and round_robin expert maps, described (docs/language.md 14.8): EP
    faked at 2 (in a world first set up for a MoE model, so that vLLM's EP group exists), on
    each rank the backend reads which placement vLLM built, the layout's shapes match
    `named_parameters`, and after vLLM's own `load_weights` of a checkpoint every local slot j
    of every routed w13 / w2 holds the checkpoint expert that the LAYOUT says slot j holds."""
    from vllm.config import set_current_vllm_config

    from layoutlang.elaborate import loads
    from layoutlang.integrations.vllm_engine import (LiveModel, _expert_placement, _routed_maps, live_problems,
                                                     replica_layout)

    tmp = tempfile.mkdtemp()
    vm.init_distributed(vm.make_vllm_config(vm.write_config(vm.QWEN3_MOE, Path(tmp) / "world")))
    builds = {"uneven": (vm.copy_config(vm.QWEN3_MOE, num_experts=5), {}),
              "round_robin": (vm.copy_config(vm.DEEPSEEK_V3, n_group=2, topk_group=1),
                              {"expert_placement_strategy": "round_robin"})}
    for name, (cfg, extra) in builds.items():
        weights = checkpoint(cfg, 1)
        for rank in range(2):
            with vm.fake_tp(rank, 2):
                vc, model = vm.build(cfg, Path(tmp) / f"{name}{rank}", enable_expert_parallel=True, **extra)
                vc.parallel_config.tensor_parallel_size = 2
                with set_current_vllm_config(vc), vm.cpu_accelerator_noops():
                    placement, problems = _expert_placement(vc, model, rank)
                    layout = loads(replica_layout(vc, placement), "engine.layout")
                    problems += live_problems(layout, rank, LiveModel.of(model, True))
                    vm.load_hf_weights(model, weights, vc)
            params = dict(model.named_parameters())
            slots, wrong = {}, []
            for path in _routed_maps(model):
                w13 = next(t for t in layout.tensors if t.name == f"{path}.w13_weight")
                experts = [r.logical_start + i for r in w13.runs(rank)[0] for i in range(r.length)]
                slots[path] = experts
                block = path.removesuffix(".routed_experts")
                for j, e in enumerate(experts):
                    gate_up = torch.cat([weights[f"{block}.{e}.gate_proj.weight"], weights[f"{block}.{e}.up_proj.weight"]])
                    if not torch.equal(params[f"{path}.w13_weight"][j], gate_up.to(params[f"{path}.w13_weight"].dtype)):
                        wrong.append(f"{path}.w13_weight[{j}] (expert {e})")
                    down = weights[f"{block}.{e}.down_proj.weight"]
                    if not torch.equal(params[f"{path}.w2_weight"][j], down.to(params[f"{path}.w2_weight"].dtype)):
                        wrong.append(f"{path}.w2_weight[{j}] (expert {e})")
            say(case=name, rank=rank, placement=placement, problems=problems[:6], slots=slots, wrong=wrong[:6])
    say(ok=True)  # the test reads each case's line


# EPLB: Qwen3-MoE (4 experts, 2 MoE layers) with 2 redundant experts, EP faked at 2: P = 6
# physical slots, 3 per rank (vLLM's linear map: rank r holds slots 3r .. 3r + 2). Before
# refit STEP, vLLM's map is EPLB_MAPS[STEP] (physical slot -> logical expert, per MoE layer),
# set as EplbState sets it: views of logical_to_physical_map / logical_replica_count, written in
# place on a rebalance. Step 2 rebalances, step 3 keeps step 2's map.
EPLB_REDUNDANT = 2
EPLB_MAPS = {1: [[0, 1, 2, 3, 1, 2], [3, 2, 1, 0, 0, 3]],
             2: [[2, 0, 3, 1, 3, 0], [1, 1, 0, 2, 3, 2]],
             3: [[2, 0, 3, 1, 3, 0], [1, 1, 0, 2, 3, 2]]}
EPLB_PARALLEL = {"enable_eplb": True, "eplb_config.num_redundant_experts": EPLB_REDUNDANT}


def eplb_state(rows: list[list[int]], experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical -> physical form of a physical -> logical map: [layers, E, R + 1] slots
    (-1 padded) and each expert's replica count."""
    l2p = torch.full((len(rows), experts, EPLB_REDUNDANT + 1), -1, dtype=torch.int64)
    count = torch.zeros((len(rows), experts), dtype=torch.int64)
    for i, row in enumerate(rows):
        for p, e in enumerate(row):
            l2p[i, e, count[i, e]] = p
            count[i, e] += 1
    return l2p, count


def run_eplb_engine(port: int, rank: int) -> None:
    """One worker of an EPLB replica: the backend reads vLLM's live map at each update, the
    trainer re-plans for it; after each refit every physical slot holds its logical expert of
    that step's checkpoint (the slot rule written out here, not read from a layout), and every
    other parameter equals vLLM's own load of that checkpoint."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    cfg = vm.QWEN3_MOE
    experts, tp = cfg["num_experts"], 2
    per_rank = (experts + EPLB_REDUNDANT) // tp
    tmp = tempfile.mkdtemp()
    vm.init_distributed(vm.make_vllm_config(vm.write_config(cfg, Path(tmp) / "world")))
    with vm.fake_tp(rank, tp):
        vc, model = vm.build(cfg, Path(tmp) / "engine", enable_expert_parallel=True, parallel=EPLB_PARALLEL)
        _, oracle = vm.build(cfg, Path(tmp) / "oracle", enable_expert_parallel=True, parallel=EPLB_PARALLEL)
        vc.parallel_config.tensor_parallel_size = tp
        l2p, count = eplb_state(EPLB_MAPS[1], experts)
        moe = get_mixture_of_experts_model(model)
        moe.set_eplb_state(torch.zeros((len(EPLB_MAPS[1]), experts + EPLB_REDUNDANT)), l2p, count)
        engine = make_engine(vc, model)
        with set_current_vllm_config(vc), vm.cpu_accelerator_noops():
            engine.init_transfer_engine(engine.parse_init_info(
                {"address": f"127.0.0.1:{port}", "replica": REPLICA, "timeout": TIMEOUT}))
            digests = []
            for step in range(1, STEPS + 1):
                new_l2p, new_count = eplb_state(EPLB_MAPS[step], experts)
                l2p.copy_(new_l2p)  # EplbState rebalances in place: the layers hold views
                count.copy_(new_count)
                engine.start_weight_update()
                engine.update_weights({"version": step})
                engine.finish_weight_update()
                digests.append(engine.job.one.digest)
                weights = checkpoint(cfg, step)
                vm.load_hf_weights(oracle, weights, vc)
                routed = ("routed_experts.w13_weight", "routed_experts.w2_weight")
                diff = [n for n in differences(model, oracle) if not n.endswith(routed)]
                params, wrong, slots = dict(model.named_parameters()), [], {}
                for i in range(cfg["num_hidden_layers"]):
                    block = f"model.layers.{i}.mlp.experts"
                    slots[i] = [EPLB_MAPS[step][i][rank * per_rank + j] for j in range(per_rank)]
                    for j, e in enumerate(slots[i]):
                        gate_up = torch.cat([weights[f"{block}.{e}.gate_proj.weight"],
                                             weights[f"{block}.{e}.up_proj.weight"]])
                        if not torch.equal(params[f"{block}.routed_experts.w13_weight"][j], gate_up):
                            wrong.append(f"layer {i} w13 slot {j} (expert {e})")
                        if not torch.equal(params[f"{block}.routed_experts.w2_weight"][j],
                                           weights[f"{block}.{e}.down_proj.weight"]):
                            wrong.append(f"layer {i} w2 slot {j} (expert {e})")
                say(role="eplb", rank=rank, step=step, version=engine.version, differ=diff[:10], wrong=wrong[:10],
                    slots=slots, layout=digests[-1][:12])
                if diff or wrong or engine.version != step:
                    sys.exit(1)
            # a map that is no map (two logical experts in slot 1 of MoE layer 1): refused at the
            # next update, before anything is entered or published
            bad = [list(row) for row in EPLB_MAPS[STEPS]]
            l2p[1, bad[1][2], 0] = 1
            try:
                engine.start_weight_update()
                refused = None
            except Exception as exc:  # noqa: BLE001 - reported
                refused = f"{type(exc).__name__}: {exc}"
            say(role="eplb", rank=rank, case="bad map", message=refused, entered=engine.live.entered,
                layout=engine.job.one.digest[:12])
            say(role="eplb", rank=rank, case="refusals", messages=eplb_refusals(engine, model, l2p, count, experts))
            engine.shutdown()
    say(ok=True, role="eplb", rank=rank, layouts=len(set(digests)))


def eplb_refusals(engine, model, l2p, count, experts: int) -> dict:
    """What the backend says of live EPLB states that are no map of the layout's table, each
    set in place on step 3's map (tests/test_vllm.py holds the expected messages)."""
    from types import SimpleNamespace

    from layoutlang.integrations.vllm_engine import live_eplb_map

    def said(fn):
        good_l2p, good_count = eplb_state(EPLB_MAPS[STEPS], experts)
        l2p.copy_(good_l2p)
        count.copy_(good_count)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - reported
            return f"{type(exc).__name__}: {exc}"

    def out_of_range():
        l2p[0, 0, 0] = experts + EPLB_REDUNDANT  # expert 0's first copy in slot 6 of 6
        live_eplb_map(model, 2, experts, EPLB_REDUNDANT)

    def slot_left_empty():
        count[0, 0] = 1  # expert 0 of layer 0 had slots 1 and 5: slot 5 now holds nothing
        live_eplb_map(model, 2, experts, EPLB_REDUNDANT)

    return {"layers": said(lambda: live_eplb_map(model, 3, experts, EPLB_REDUNDANT)),
            "out of range": said(out_of_range), "empty slot": said(slot_left_empty),
            "no table": said(lambda: engine._live_map(SimpleNamespace(args=(("N", 4),)))),
            "good": said(lambda: live_eplb_map(model, 2, experts, EPLB_REDUNDANT))}


def run_eplb_trainer(port: int) -> None:
    from layoutlang.elaborate import loads
    from layoutlang.integrations.vllm import engine_layout
    from layoutlang.runtime import TrainerJob

    cfg = vm.QWEN3_MOE
    text = engine_layout(cfg, dtype="float32", tp=2, ep=2, redundant_experts=EPLB_REDUNDANT)
    job = TrainerJob(loads(hf_text(cfg), "hf.layout"), loads(text, "vllm-replica.layout"),
                     address=f"127.0.0.1:{port}", rank=0, world_size=1, timeout=TIMEOUT)
    for step in range(1, STEPS + 1):
        report = job.refit(checkpoint(cfg, step), step, expect=(REPLICA,))
        say(role="trainer", step=step, replicas=list(report.replicas), missed=list(report.missed),
            reasons=report.reasons)
        if list(report.replicas) != [REPLICA]:
            sys.exit(1)
    job.close()
    say(ok=True, role="trainer")


def run_llm(port: int) -> None:
    """A whole `vllm.LLM` (engine core and worker in this process) started with
    `weight_transfer_config={"backend": "layoutlang"}`: vLLM's worker builds the backend in
    its `load_model`, and the `layoutlang` trainer from vLLM's trainer factory, given the `LLM`
    itself as its client, drives it through `LLM`'s own RL calls (init_weight_transfer_engine,
    start_weight_update, update_weights, finish_weight_update(weight_version)) around three
    refits of its job; each step's parameters, read through `collective_rpc`, equal vLLM's own
    load of that step's checkpoint into an oracle model."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from layoutlang.integrations.vllm_engine import LayoutlangTrainerInitInfo

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU worker takes ~90 % of the machine's memory for its KV cache unless told (GiB)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    cfg = vm.LLAMA
    tmp = tempfile.mkdtemp()
    with vm.cpu_accelerator_noops():
        llm = vm.make_llm(cfg, Path(tmp) / "llm", weight_transfer_config={"backend": "layoutlang"})
        vc, oracle = vm.build(cfg, Path(tmp) / "oracle")  # vLLM's world exists already: joins it
        train = Path(tmp) / "hf.layout"
        train.write_text(hf_text(cfg))
        info = LayoutlangTrainerInitInfo(train=str(train), infer=engine_text(cfg), address=f"127.0.0.1:{port}",
                                         world_size=1, replica=REPLICA, timeout=TIMEOUT, rank=0)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm)
        kinds = llm.collective_rpc(lambda w: type(w.weight_transfer_engine).__name__)
        for step in range(1, STEPS + 1):
            report = trainer.send_weights(checkpoint(cfg, step), step)
            (live,) = llm.collective_rpc(lambda w: {n: p.detach().clone() for n, p in
                                                   w.model_runner.get_model().named_parameters()})
            vm.load_hf_weights(oracle, checkpoint(cfg, step), vc)
            want = dict(oracle.named_parameters())
            diff = sorted(n for n in set(live) | set(want)
                          if n not in live or n not in want or not torch.equal(live[n], want[n]))
            say(role="llm", step=step, version=llm.get_weight_version(), differ=diff[:10],
                replicas=list(report.replicas))
            if diff or llm.get_weight_version() != str(step) or list(report.replicas) != [REPLICA]:
                sys.exit(1)
        llm.shutdown_weight_transfer_engine()
        trainer.shutdown()
    say(ok=True, role="llm", engines=kinds)


def run_plugin() -> None:
    """vLLM's own plugin loader finds the entry point and registers the backend in both factories."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    found = {"engine": "layoutlang" in WeightTransferEngineFactory._registry,
             "trainer": "layoutlang" in WeightTransferTrainerFactory._registry}
    say(ok=all(found.values()), **found)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "engine":
        run_engine(sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:6]))
    elif role == "trainer":
        run_trainer(sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:5]))
    elif role == "driven":
        run_driven(int(sys.argv[2]))
    elif role == "refused":
        run_refused()
    elif role == "llm":
        run_llm(int(sys.argv[2]))
    elif role == "placement":
        run_placement()
    elif role == "plugin":
        run_plugin()
    elif role == "eplb_engine":
        run_eplb_engine(int(sys.argv[2]), int(sys.argv[3]))
    elif role == "eplb_trainer":
        run_eplb_trainer(int(sys.argv[2]))
    os._exit(0)  # vLLM's atexit handlers call torch.accelerator on a machine without one
