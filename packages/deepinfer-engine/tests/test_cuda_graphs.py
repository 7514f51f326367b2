"""CUDA-graph sizes (CPU) and graph replay against the eager decode (GPU only)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.cuda_graphs import graph_sizes


def test_graph_sizes_follow_the_design() -> None:
    assert graph_sizes(1) == (1,)
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(30) == (1, 2, 4, 8, 16, 24, 30)
    assert graph_sizes(64, 16) == (1, 2, 4, 8, 16, 32, 48, 64)
    with pytest.raises(ValueError, match="max_size=0"):
        graph_sizes(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_decode() -> None:
    from deepinfer.engine.core.cuda_graphs import DecodeGraphs
    from deepinfer.model import DeepseekV4Config, ForwardBatch, ModelCache
    from deepinfer.model.model import build_model

    cfg = DeepseekV4Config.from_dict(dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, num_hash_layers=1, sliding_window=8, hc_mult=2,
        hc_sinkhorn_iters=3, index_n_heads=4, index_head_dim=16, index_topk=3, max_position_embeddings=256,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}))
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)   # CUDA grouped-GEMM MoE: bf16
    model.init_weights(seed=0, std=0.2)
    model.eval()
    spec = model.cache_spec(16)
    eager_cache = ModelCache.allocate(spec, 41, 8, "cuda")
    graph_cache = ModelCache.allocate(spec, 41, 8, "cuda")
    graphs = DecodeGraphs(model, graph_cache, max_seqs=6, max_blocks=8, max_context_len=128, interval=4)
    gen = torch.Generator().manual_seed(1)
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(5)]
    lengths = [3, 17, 9, 30, 1]
    for cache in (eager_cache, graph_cache):       # same prefill into both caches
        prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
        model(ForwardBatch.build(prompts, [0] * 5, tables, [1, 2, 3, 4, 5], device="cuda"), cache)
    for step in range(12):
        toks = torch.randint(0, 96, (5,), generator=gen).tolist()
        batch = ForwardBatch.build([[t] for t in toks], [n + step for n in lengths], tables, [1, 2, 3, 4, 5],
                                   device="cuda")
        eager = model(batch, eager_cache)
        replay = graphs.run(batch)
        # bf16; the graph gathers compressed entries up to its captured context bound, eager up to
        # the batch's, so reductions differ in length (not in content)
        assert (replay - eager).abs().max() <= 2e-2 * eager.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_decode_steps_hold_the_tables_from_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (ZOS, requests arriving and ending at different steps): every staged decode
    step's graph inputs hold its block tables as built from scratch, padded with zeros, though only
    new rows and appended blocks were copied (`RowBlockTables`)."""
    import numpy as np

    from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams

    monkeypatch.setenv("DEEPINFER_DISABLE_SYNC_GUARD", "1")     # the check below reads the device
    # a fixed cache, not 0.9 of the card: tools/gpu_tests.sh runs this beside other GPU tests
    engine = LLMEngine(EngineArgs(device="cuda", dtype="bfloat16", max_num_seqs=8, block_size=16,
                                  kv_cache_memory_mb=256))
    runner = engine.runner
    assert runner.graphs is not None
    staged = runner._staged_decode_step
    checked = []

    def checking(d, in_flight):
        step = staged(d, in_flight)
        want = np.zeros((d.num_seqs, runner.graphs.block_tables.shape[1]), dtype=np.int32)
        want[:, : d.block_tables.shape[1]] = d.block_tables
        size = runner.graphs.bucket(d.num_seqs)
        tables = runner.graphs.block_tables[:size].cpu().numpy()      # waits for the step's copies
        assert (tables[: d.num_seqs] == want).all() and not tables[d.num_seqs:].any()
        assert runner.graphs.seq_rows[: d.num_seqs].cpu().tolist() == d.rows.tolist()
        checked.append(d.num_seqs)
        return step

    runner._staged_decode_step = checking
    prompts = ["def fibonacci(", "import os\n" * 5, "class Parser:" * 9, "x = ["]
    for step in range(60):
        if step % 7 == 0:
            engine.add_request(None, prompts[step % 4], SamplingParams(temperature=0.0, ignore_eos=True,
                                                                      max_tokens=10 + 9 * (step % 5)))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 30 and max(checked) > 2
