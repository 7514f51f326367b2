"""Multi-token decode (`ForwardBatch.multi_decode`, the static-shape verify forward): the same logits
as the per-sequence path for rows of mixed query lengths, across compression window closures, after
prefills of various lengths, and over repeated steps whose rejected positions are rewritten."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from multi_decode_steps import multi_step

from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM, DSparkDraft, ForwardBatch, ModelCache, load_model

K = 7                       # drafts per row: rows feed 1 … K + 1 query tokens
BACKTRACK = K + 1           # spare ring rows, as the engine sizes them (DEEPINFER_MAX_BACKTRACKING_TOKENS >= k + 1)
BLOCK = 16
NUM_BLOCKS_PER_ROW = 16
NUM_ROWS = 4

RAW = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 16, "num_hash_layers": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3,
    "max_position_embeddings": 512,
}
QUANT = {**RAW, "head_dim": 80, "qk_rope_head_dim": 16, "index_head_dim": 32}    # kv_quant: 64 nope dims


def _model(raw: dict, kv_quant: bool, seed: int = 0) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(raw), kv_quant=kv_quant)
    model.init_weights(seed, std=0.1)
    with torch.no_grad():            # make the inert-by-default parameters matter
        for name, p in model.named_parameters():
            if name.endswith(("_base", "attn_sink", ".ape")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def _cache(model, backtrack: int = BACKTRACK) -> ModelCache:
    return ModelCache.allocate(model.cache_spec(BLOCK, backtrack), num_blocks=1 + NUM_ROWS * NUM_BLOCKS_PER_ROW,
                               num_slots=NUM_ROWS + 1)


def _tables() -> list[list[int]]:
    """Row i owns blocks 1 + i·16 … (non-contiguous order inside, to exercise the tables)."""
    return [list(range(1 + i * NUM_BLOCKS_PER_ROW, 1 + (i + 1) * NUM_BLOCKS_PER_ROW))[::-1] for i in range(NUM_ROWS)]


SLOTS = [1 + i for i in range(NUM_ROWS)]


def _per_sequence(model, cache, chunks: list[list[int]], starts: list[int], rows: list[int]) -> torch.Tensor:
    """The per-sequence (prefill) path over one chunk per row; logits of every token, row by row."""
    tables = _tables()
    batch = ForwardBatch.build(chunks, starts, [tables[r] for r in rows], [SLOTS[r] for r in rows], logits="all")
    assert not batch.uniform_decode or all(len(c) == 1 for c in chunks)
    with torch.no_grad():
        return model(batch, cache)


def _multi(model, cache, chunks: list[list[int]], starts: list[int], *, max_query_len: int = K + 1,
           order: np.ndarray | None = None, pad: int = 0) -> torch.Tensor:
    """`multi_decode_steps.multi_step` over this module's block tables and slots."""
    return multi_step(model, cache, chunks, starts, np.array(_tables()), SLOTS, max_query_len=max_query_len,
                      order=order, pad=pad)


def _prefill(model, cache, prompts: list[list[int]]) -> None:
    _per_sequence(model, cache, prompts, [0] * len(prompts), list(range(len(prompts))))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(4, vocab, n).tolist()


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5, rtol: float = 0.0) -> None:
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kv_quant", [False, True])
@pytest.mark.parametrize("prompt_lens", [(3, 14, 31, 62), (1, 15, 16, 57), (9, 4, 63, 100)])
def test_mixed_query_lengths_match_the_per_sequence_path(kv_quant: bool, prompt_lens: tuple[int, ...]) -> None:
    """Rows of 1, 2, 6 and K + 1 tokens in one batch (in shuffled order), crossing ratio-4 and
    ratio-16 window closures and the window edge, after prefills of various lengths."""
    raw = QUANT if kv_quant else RAW
    model = _model(raw, kv_quant)
    rng = np.random.default_rng(sum(prompt_lens))
    prompts = [_tokens(rng, n, raw["vocab_size"]) for n in prompt_lens]
    chunks = [_tokens(rng, q, raw["vocab_size"]) for q in (1, 2, 6, K + 1)]
    want_cache, got_cache = _cache(model), _cache(model)
    _prefill(model, want_cache, prompts)
    _prefill(model, got_cache, prompts)
    want = _per_sequence(model, want_cache, chunks, list(prompt_lens), list(range(NUM_ROWS)))
    got = _multi(model, got_cache, chunks, list(prompt_lens), order=rng.permutation(sum(map(len, chunks))))
    _close(got, want)
    for name, ring in want_cache.state.items():       # what the two paths leave behind agrees too
        torch.testing.assert_close(got_cache.state[name][1:], ring[1:], atol=1e-5, rtol=0, msg=name)
    for name, paged in want_cache.paged.items():
        torch.testing.assert_close(got_cache.paged[name][1:], paged[1:], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("kv_quant", [False, True])
def test_steps_with_rejected_drafts_match_fresh_per_sequence_runs(kv_quant: bool) -> None:
    """Speculative decoding's pattern: each step feeds [anchor, drafts] per row, keeps a random prefix,
    and the next step starts after it, rewriting the rejected positions. Every step's logits equal
    the per-sequence path taking the same steps (its own cache, rejected positions rewritten alike)
    and a fresh cache's per-sequence run over the committed history, then the step's tokens.

    With kv_quant the fresh run compresses the history in other chunks, whose float32 rows differ in
    the last bits; an FP8 rounding then may flip (the per-sequence path alone shows the same 2e-4
    gap), so that comparison allows 1e-3 and asks for the same greedy tokens."""
    raw = QUANT if kv_quant else RAW
    model = _model(raw, kv_quant, seed=3)
    rng = np.random.default_rng(7)
    history = [_tokens(rng, n, raw["vocab_size"]) for n in (2, 13, 29, 47)]
    cache, same_steps = _cache(model), _cache(model)
    _prefill(model, cache, history)
    _prefill(model, same_steps, history)
    for step in range(8):
        lens = [1, 2, 6, K + 1] if step == 0 else rng.integers(1, K + 2, NUM_ROWS).tolist()
        chunks = [_tokens(rng, q, raw["vocab_size"]) for q in lens]
        starts = [len(h) for h in history]
        got = _multi(model, cache, chunks, starts, order=rng.permutation(sum(lens)))
        _close(got, _per_sequence(model, same_steps, chunks, starts, list(range(NUM_ROWS))))
        fresh = _cache(model)
        _prefill(model, fresh, history)
        _close(got, _per_sequence(model, fresh, chunks, starts, list(range(NUM_ROWS))), 1e-3 if kv_quant else 1e-5)
        for h, chunk in zip(history, chunks):
            h.extend(chunk[: 1 + int(rng.integers(0, len(chunk)))])    # the anchor + accepted drafts
    assert min(len(h) for h in history) > 16          # the steps crossed ratio-16 closures on every row


def test_one_token_rows_equal_the_batched_decode_path() -> None:
    model = _model(RAW, False)
    rng = np.random.default_rng(1)
    prompts = [_tokens(rng, n, RAW["vocab_size"]) for n in (5, 15, 22, 63)]
    tokens = _tokens(rng, NUM_ROWS, RAW["vocab_size"])
    results = []
    for max_query_len in (None, 1, K + 1):
        cache = _cache(model)
        _prefill(model, cache, prompts)
        if max_query_len is None:
            seq_lens = np.array([len(p) + 1 for p in prompts])
            batch = ForwardBatch.decode(np.array(tokens), seq_lens, np.array(_tables()), np.array(SLOTS))
            with torch.no_grad():
                results.append(model(batch, cache))
        else:
            results.append(_multi(model, cache, [[t] for t in tokens], [len(p) for p in prompts],
                                  max_query_len=max_query_len))
    assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0])


def test_padding_tokens_change_nothing() -> None:
    """A graph keyed by total_q pads the step with tokens at position 0 of the dummy slot 0 and an
    all-zero block table: the real tokens' logits and rows are unchanged."""
    model = _model(RAW, False)
    rng = np.random.default_rng(2)
    prompts = [_tokens(rng, n, RAW["vocab_size"]) for n in (6, 14, 30, 45)]
    chunks = [_tokens(rng, q, RAW["vocab_size"]) for q in (3, K + 1, 1, 5)]
    starts = [len(p) for p in prompts]
    plain, padded = _cache(model), _cache(model)
    _prefill(model, plain, prompts)
    _prefill(model, padded, prompts)
    want = _multi(model, plain, chunks, starts)
    _close(_multi(model, padded, chunks, starts, pad=7), want)
    for name, ring in plain.state.items():
        torch.testing.assert_close(padded.state[name][1:], ring[1:], atol=1e-6, rtol=0, msg=name)


def test_rings_too_short_for_the_query_length_are_refused() -> None:
    model = _model(RAW, False)
    cache = _cache(model, backtrack=2)
    with pytest.raises(ValueError, match=r"cache_spec\(max_backtracking >= 3\)"):
        _multi(model, cache, [[5, 6, 7, 8]], [0], max_query_len=4)


def test_multi_decode_refuses_inconsistent_inputs() -> None:
    one = np.array([1])
    tables, slots = np.zeros((1, 2), dtype=np.int32), np.array([1])
    with pytest.raises(ValueError, match="one entry per token"):
        ForwardBatch.multi_decode(one, np.array([1, 2]), one * 0, tables, slots, max_query_len=2)
    with pytest.raises(ValueError, match="host max_context_len"):
        ForwardBatch.multi_decode(one, torch.tensor([3]), one * 0, tables, slots, max_query_len=2)
    with pytest.raises(ValueError, match="max_query_len=0"):
        ForwardBatch.multi_decode(one, one, one * 0, tables, slots, max_query_len=0)
    batch = ForwardBatch.multi_decode(torch.tensor([4, 5]), torch.tensor([7, 8]), torch.tensor([0, 0]),
                                      torch.tensor([[3, 9]], dtype=torch.int32), torch.tensor([2]), max_query_len=2,
                                      max_context_len=32)
    assert batch.uniform_decode and batch.num_seqs == 2 and batch.start_positions == (0, 0)
    assert batch.block_tables.tolist() == [[3, 9], [3, 9]] and batch.state_slots.tolist() == [2, 2]
    assert batch.logits_indices.tolist() == [0, 1] and batch.max_context_len == 32


def test_the_embedded_model_with_its_draft_head() -> None:
    """The shipped model (window 64, ratios 4 and 16) with its DSpark head attached (the forward also
    writes the draft rings): a mixed step, then rejected-draft steps, equal the per-sequence path.
    Its logits reach 13 in magnitude, so float32 sums in another order differ by ~1e-6 relative:
    1e-5 absolute plus 1e-5 relative."""
    from deepinfer.model.embedded import embedded_model_dir
    model = load_model(embedded_model_dir()).eval()
    model.attach_draft(DSparkDraft.from_model(model))
    k = model.cfg.dspark_block_size
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(11)
    history = [_tokens(rng, n, vocab) for n in (4, 60, 127, 190)]
    want_cache, got_cache = _cache(model, k + 1), _cache(model, k + 1)
    _prefill(model, want_cache, history)
    _prefill(model, got_cache, history)
    for step in range(3):
        lens = [1, 2, k + 1, k] if step == 0 else rng.integers(1, k + 2, NUM_ROWS).tolist()
        chunks = [_tokens(rng, q, vocab) for q in lens]
        starts = [len(h) for h in history]
        got = _multi(model, got_cache, chunks, starts, max_query_len=k + 1)
        _close(got, _per_sequence(model, want_cache, chunks, starts, list(range(NUM_ROWS))), rtol=1e-5)
        for h, chunk in zip(history, chunks):
            h.extend(chunk[: 1 + int(rng.integers(0, len(chunk)))])
    for name in ("mtp.0.window", "layers.1.compressor.kv", "layers.2.window"):
        torch.testing.assert_close(got_cache.state[name][1:], want_cache.state[name][1:], atol=1e-5, rtol=0)

