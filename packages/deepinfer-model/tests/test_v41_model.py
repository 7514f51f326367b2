"""DeepSeek-V4.1 model: prefill = chunked prefill = decode, batching, and the spec's formulas."""

from __future__ import annotations

import pytest
import torch
from v41_configs import tiny_text
from v41_helpers import run_chunks, tiny_model

from deepinfer.kernels.reference import apply_rope, engram_primes, fake_quant_fp4_rows
from deepinfer.model import ConfigError, DeepseekV41Config, DeepseekV41ForCausalLM, ForwardBatch, ModelCache
from deepinfer.model.layers.engram import hash_multipliers

# float32: only summation order differs, but a value that lands within an ulp of a rounding boundary of the
# packed FP4 / MXFP8 caches can re-round to the neighbouring code on one path (seen on an AMD EPYC CPU:
# 1 byte in 1,980), which moves later logits by a few 1e-4.
ATOL = 5e-4
MAX_FLIPPED_BYTES = 2     # packed cache bytes allowed to differ between two paths (rounding ties)


@pytest.fixture(scope="module")
def model() -> DeepseekV41ForCausalLM:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def one_shot(model, tokens) -> torch.Tensor:
    return run_chunks(model, [tokens], [[37]])[0]


def test_every_layer_kind_is_present(model) -> None:
    cfg = model.cfg
    assert cfg.compress_ratios[:2] == (0, 0) and set(cfg.compress_ratios) == {0, 1, 2}
    assert set(cfg.index_source_layer_ids) - set(cfg.kv_source_layer_ids) == {9}          # a reindex layer
    assert 7 < 9 and cfg.candidate_source_layer_id == 7 and set(cfg.engram_layer_ids) == {1, 5}
    assert model.layers[3].attn.compressor is None and model.layers[3].attn.indexer is None  # reuse layer


@pytest.mark.parametrize("cuts", [[5, 1, 12, 19], [1, 2, 3, 31], [36, 1], [8, 8, 8, 8, 5]])
def test_chunked_prefill_cut_anywhere_equals_one_shot(model, tokens, one_shot, cuts) -> None:
    torch.testing.assert_close(run_chunks(model, [tokens], [cuts])[0], one_shot, atol=ATOL, rtol=0)


def test_token_by_token_and_multi_token_decode_equal_one_shot(model, tokens, one_shot) -> None:
    torch.testing.assert_close(run_chunks(model, [tokens], [[20] + [1] * 17])[0], one_shot, atol=ATOL, rtol=0)
    torch.testing.assert_close(run_chunks(model, [tokens], [[10] + [3] * 9])[0], one_shot, atol=ATOL, rtol=0)


def test_batched_sequences_equal_each_alone(model, tokens, one_shot) -> None:
    other = tokens[::-1][:23]
    alone = run_chunks(model, [other], [[23]])[0]
    both = run_chunks(model, [tokens, other], [[9, 4, 1, 1, 22], [2, 7, 1, 13]])
    torch.testing.assert_close(both[0], one_shot, atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], alone, atol=ATOL, rtol=0)


def test_indexer_and_engram_matter(model, tokens, one_shot) -> None:
    """The compressed branch and Engram change the logits (so the equalities above test them)."""
    sparse = tiny_model(seed=0, index_topk=1, candidate_topk_blocks=1)
    assert (run_chunks(sparse, [tokens], [[37]])[0] - one_shot).abs().max() > 1e-3
    cold = tiny_model(seed=0)
    with torch.no_grad():
        cold.layers[5].engram.embed.weight.zero_()
    assert (run_chunks(cold, [tokens], [[37]])[0][5:] - one_shot[5:]).abs().max() > 1e-3


def _source_rows(model, tokens, layer, cuts) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded paged rows (compressed KV, index keys) of KV source `layer` after feeding `tokens`."""
    spec = model.cache_spec(8, 2)
    cache = ModelCache.allocate(spec, 8, 2)
    start = 0
    for c in cuts:
        batch = ForwardBatch.build([tokens[start:start + c]], [start], [[1, 2, 3, 4, 5, 6]], [1])
        with torch.no_grad():
            model(batch, cache)
        start += c
    codecs = model.codecs()
    r = model.cfg.compress_ratios[layer]
    n = start // r
    kv = cache.paged[f"layers.{layer}.kv"][1:7].flatten(0, 1)[:n]
    keys = cache.paged[f"layers.{layer}.index_k"][1:7].flatten(0, 1)[:n]
    return codecs.kv.decode(kv, torch.float32), codecs.index.decode(keys, torch.float32)


def _layer_input(model, tokens, layer) -> torch.Tensor:
    """The normed attention input x of `layer` for every token (captured by a hook)."""
    seen = {}

    def grab(module, args):
        seen.setdefault("x", args[0])

    handle = model.layers[layer].attn.register_forward_pre_hook(grab)
    run_chunks(model, [tokens], [[len(tokens)]])
    handle.remove()
    return seen["x"]


@pytest.mark.parametrize(("layer", "ratio"), [(2, 2), (7, 1)])
def test_csa2_compression_follows_the_formula(model, tokens, layer, ratio) -> None:
    """Ratio 2: latent_w = norm(Σ_{t∈w} softmax_t(wgate x_t) · wkv x_t) per channel; ratio 1:
    latent_t = norm(wkv x_t). Index key = FP4_32(rope(k_norm(wk latent))); row = FP4_16(rope(latent)),
    RoPE at the group's first position. Checked after a chunked prefill that cuts groups."""
    attn, cfg = model.layers[layer].attn, model.cfg
    x = _layer_input(model, tokens, layer).float()
    comp = attn.compressor
    if ratio == 2:
        k, g = x @ comp.wkv.weight.float().t(), x @ comp.wgate.weight.float().t()
        n = x.shape[0] // 2
        w = torch.softmax(g[:2 * n].view(n, 2, -1), dim=1)
        pooled = (k[:2 * n].view(n, 2, -1) * w).sum(1)
    else:
        pooled = x @ comp.wkv.weight.float().t()
    rms = lambda v, weight: v * torch.rsqrt(v.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight  # noqa: E731
    latent = rms(pooled, comp.norm.weight.float())
    pos = torch.arange(latent.shape[0]) * ratio
    rope = model.compress_inv_freq
    key = fake_quant_fp4_rows(apply_rope(rms(latent @ attn.indexer.wk.weight.float().t(),
                                             attn.indexer.k_norm.weight.float()), pos, rope), e4m3_scales=False)
    row = fake_quant_fp4_rows(apply_rope(latent, pos, rope), e4m3_scales=True)
    got_row, got_key = _source_rows(model, tokens, layer, [3, 1, 6, 27])
    torch.testing.assert_close(got_row, row, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_key, key, atol=1e-5, rtol=1e-5)


def test_engram_multipliers_are_numpy_pcg64_odd_and_bounded() -> None:
    import numpy as np

    m = hash_multipliers((1, 14), 4, 99092)
    bound = (2**63 - 1) // 99092 // 2
    want = np.random.default_rng(10007 * 14).integers(0, bound, size=4, dtype=np.int64) * 2 + 1
    assert m.dtype == torch.int64 and m.shape == (2, 4) and m[1].tolist() == want.tolist()
    assert bool((m % 2 == 1).all()) and int(m.max()) < 2 * bound + 1


def test_engram_hash_ids_by_hand(model) -> None:
    """Layer 1's ids (table index 0) at positions 1 and 2 of [10, 20, 30]: c = (t_p, t_{p-1}, t_{p-2}),
    the pad id where the look-back passes the sequence start (identity token map)."""
    cfg, hasher = model.cfg, model.hasher
    cache = ModelCache.allocate(model.cache_spec(8, 0), 2, 2)
    ids = hasher(ForwardBatch.build([[10, 20, 30]], [0], [[1]], [1]), cache.state["engram.history"])
    primes = engram_primes(2, 3, 2, cfg.engram_vocab_size)[0]
    m = hasher.multipliers[0].tolist()

    def expected(c0: int, c1: int, c2: int) -> list[int]:
        r1 = (c0 * m[0]) ^ (c1 * m[1])
        r2 = r1 ^ (c2 * m[2])
        return [r1 % primes[0][0], r1 % primes[0][1] + primes[0][0],
                r2 % primes[1][0] + sum(primes[0]), r2 % primes[1][1] + sum(primes[0]) + primes[1][0]]

    assert ids[2, 0].tolist() == expected(30, 20, 10)
    assert ids[1, 0].tolist() == expected(20, 10, cfg.engram_pad_id)
    assert ids[0, 0].tolist() == expected(10, cfg.engram_pad_id, cfg.engram_pad_id)
    assert cache.state["engram.history"][1].tolist() == [30, 20]    # 2 slots, by position mod 2
    decode = hasher(ForwardBatch.build([[40]], [3], [[1]], [1]), cache.state["engram.history"])
    assert decode[0, 0].tolist() == expected(40, 30, 20)             # the history carries the look-back


def test_a_token_map_of_the_wrong_size_is_refused() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match="compressed vocabulary has 95 ids"):
        model.bind_token_map(torch.arange(96) % 95)
    unbound = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(tiny_text()))
    with pytest.raises(ValueError, match="bind_token_map"):
        run_chunks(unbound, [[5, 6]], [[2]])


def test_matches_an_independent_full_sequence_twin(model, tokens, one_shot) -> None:
    """The engine path (paged rows, rings, per-sequence gathers) against `v41_twin` (whole-sequence
    masks in transformers' shape), on every row of a prompt that crosses many candidate blocks."""
    from v41_twin import twin_logits

    torch.testing.assert_close(one_shot, twin_logits(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides", [
    # transformers' defaults for every list (sources 2 and 7, index = sources, candidate 7), no Engram
    {"compress_ratios": None, "kv_source_layer_ids": None, "index_source_layer_ids": None,
     "candidate_source_layer_id": None, "dspark_target_layer_ids": None, "engram_layer_ids": None,
     "engram_num_embeddings": None},
    # plain rows (48 % 32 != 0), a KV source that is not an index source (5), no second level,
    # top-1 routing without renormalisation, no SwiGLU clamp, 4 streams
    {"head_dim": 48, "index_head_dim": 24, "qk_rope_head_dim": 8, "index_source_layer_ids": [2, 7, 9],
     "candidate_source_layer_id": -1, "num_experts_per_tok": 1, "swiglu_limit": 0, "hc_mult": 4},
])
def test_twin_on_other_schedules(overrides) -> None:
    from v41_twin import twin_logits

    model = tiny_model(seed=4, **overrides)
    tokens = torch.randint(3, 96, (26,), generator=torch.Generator().manual_seed(6)).tolist()
    got = run_chunks(model, [tokens], [[11, 1, 1, 13]])[0]
    torch.testing.assert_close(got, twin_logits(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_eager_matches_cpu(model, tokens, one_shot) -> None:
    """The same model on CUDA (the registry's GPU kernels where V4 has them, the V4.1 twins elsewhere),
    with its Engram tables on the device and then in pinned host memory."""
    cuda = tiny_model(seed=0).cuda()
    cuda.reset_rope()
    got = run_chunks(cuda, [tokens], [[20] + [1] * 17], device="cuda")[0].cpu()
    torch.testing.assert_close(got, one_shot, atol=2e-3, rtol=0)
    _graph_replay_matches_eager(cuda)
    cuda.engram_on_host = True
    cuda.place_engram_tables()
    assert cuda.layers[1].engram.embed.weight.is_pinned()
    got = run_chunks(cuda, [tokens], [[37]], device="cuda")[0].cpu()
    torch.testing.assert_close(got, one_shot, atol=2e-3, rtol=0)


def test_query_blocks_do_not_change_the_result(model, tokens, one_shot, monkeypatch) -> None:
    """Long prefills gather window rows, picks and index scores in blocks of queries; tiny blocks here."""
    from deepinfer.model.layers import csa2

    monkeypatch.setattr(csa2, "PREFILL_QUERY_BLOCK", 5)
    monkeypatch.setattr(csa2, "INDEX_QUERY_BLOCK", 3)
    torch.testing.assert_close(run_chunks(model, [tokens], [[29, 8]])[0], one_shot, atol=ATOL, rtol=0)


def test_batched_decode_path_equals_the_per_sequence_path(model) -> None:
    """A uniform decode step (static shapes, no host positions) against the same step forced through
    the per-sequence path: three sequences at different positions, one graph padding row (slot 0,
    block 0, position 0) and a context bound larger than any sequence (as a captured graph has)."""
    import dataclasses

    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (13, 6, 24)]
    spec = model.cache_spec(8, 2)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]

    def prefilled() -> ModelCache:
        cache = ModelCache.allocate(spec, 13, 4)
        with torch.no_grad():
            model(ForwardBatch.build(prompts, [0, 0, 0], tables, [1, 2, 3]), cache)
        return cache

    step = ForwardBatch.build([[7], [8], [9], [0]], [13, 6, 24, 0], tables + [[0]], [1, 2, 3, 0], logits="all")
    step = dataclasses.replace(step, max_context_len=31)
    assert step.uniform_decode
    batched, per_seq = prefilled(), prefilled()
    with torch.no_grad():
        got = model(step, batched)[:3]
        want = model(dataclasses.replace(step, uniform_decode=False), per_seq)[:3]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for name in ("layers.2.kv", "layers.7.kv", "layers.7.index_k"):
        differ = (batched.paged[name][1:] != per_seq.paged[name][1:]).sum().item()
        assert differ <= MAX_FLIPPED_BYTES, (name, differ)
    for name, ring in batched.state.items():
        if ring.is_floating_point():
            torch.testing.assert_close(ring[1:], per_seq.state[name][1:], atol=ATOL, rtol=0)
        else:                             # packed rows (the ratio-2 compressor ring of CSA2)
            differ = (ring[1:] != per_seq.state[name][1:]).sum().item()
            assert differ <= MAX_FLIPPED_BYTES, (name, differ)


def _graph_replay_matches_eager(model) -> None:
    """A decode step captured in a CUDA graph (static buffers, as the engine's DecodeGraphs) and
    replayed with new inputs gives the eager logits."""
    import dataclasses

    spec = model.cache_spec(8, 2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    tables = [[1, 2, 3], [4, 5, 6]]

    def cache() -> ModelCache:
        c = ModelCache.allocate(spec, 7, 3, device="cuda")
        with torch.no_grad():
            model(ForwardBatch.build(prompts, [0, 0], tables, [1, 2], device="cuda"), c)
        return c

    step = dataclasses.replace(ForwardBatch.build([[20], [21]], [7, 4], tables, [1, 2], device="cuda"),
                               max_context_len=24)
    eager_cache, graph_cache = cache(), cache()
    with torch.no_grad():
        want = model(step, eager_cache)
        static = dataclasses.replace(step, token_ids=step.token_ids.clone(), positions=step.positions.clone())
        model(static, cache())                                   # warm-up on a throw-away cache
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(static, graph_cache)
    graph_cache2 = cache()
    for name, t in graph_cache2.paged.items():
        graph_cache.paged[name].copy_(t)
    for name, t in graph_cache2.state.items():
        graph_cache.state[name].copy_(t)
    graph.replay()
    torch.testing.assert_close(out, want, atol=2e-3, rtol=0)
