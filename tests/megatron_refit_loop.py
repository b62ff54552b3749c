# megatron_refit_loop.py: torchrun --nproc-per-node 2 megatron_refit_loop.py
# A Megatron-Core GPT trained at TP2 on ranks 0-1 feeds an HF Llama held whole on rank 0
# (collocated). The "CPU only" lines are what megatron-core (0.16 to 0.19) needs without a GPU. Imports sit
# inside main() so that importing this file (pytest's doctest collection) runs nothing.


def main() -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    from layoutlang import compile_plan, loads
    from layoutlang.bridges import hf, megatron
    from layoutlang.runtime import Refitter

    torch.cuda.current_device = lambda: "cpu"                    # CPU only
    dist.init_process_group("gloo")                              # on GPUs: nccl
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True)   # CPU only
    torch.manual_seed(0)

    # The trainer: Llama-style GPT (GQA, SwiGLU, RMSNorm, RoPE), vocabulary 500 padded to 512 (128 x TP).
    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=2,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, tensor_model_parallel_size=2, params_dtype=torch.float32,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,  # CPU only
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)  # CPU only
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=512, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # The engine: the same architecture in transformers, whole on rank 0. Rank 1 describes a meta-device
    # copy, so that both ranks compile the same plan without sending anything.
    hf_config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    with torch.random.fork_rng():   # leave the trainer's RNG alone: both TP ranks draw the same dropout
        if rank == 0:
            engine = transformers.LlamaForCausalLM(hf_config)
        else:
            with torch.device("meta"):
                engine = transformers.LlamaForCausalLM(hf_config)

    trainer_layout = loads(megatron.describe(model, vocab_size=hf_config.vocab_size), "trainer")
    engine_layout = loads(hf.describe(engine, at=0), "engine")
    plan = compile_plan(trainer_layout, engine_layout)
    refitter = Refitter(plan, timeout=60)

    ids = torch.randint(0, hf_config.vocab_size, (2, 16))        # the same batch on both TP ranks
    positions = torch.arange(16).expand(2, 16)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    for step in range(2):
        loss = model(ids, positions, causal, labels=ids).mean()  # vocab-parallel cross entropy
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # every rank, every step: the trainer ranks send their shards, rank 0's engine receives in place
        refitter.refit(megatron.tensors(model), hf.tensors(engine) if rank == 0 else None)

        model.eval()                                             # no dropout: the engine computes what
        with torch.no_grad():                                    # the trainer computes
            local = model(ids, positions, causal)                # [2, 16, 512 / 2]: this rank's vocabulary
            shards = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
            if rank == 0:
                trained = torch.cat(shards, dim=-1)[..., :hf_config.vocab_size]
                served = engine(ids).logits
                print(f"step {step}: loss {loss.item():.4f}, max |engine - trainer| logit "
                      f"{(served - trained).abs().max().item():.2e}")
        model.train()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
