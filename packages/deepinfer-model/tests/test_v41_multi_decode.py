"""DeepSeek-V4.1 multi-token decode (`ForwardBatch.multi_decode`, the static-shape verify forward, see
`layers.csa2_decode`) on the tiny config of every layer kind (window-only, ratio-2 and ratio-1 KV
sources and consumers, index sources, a reindex layer, the candidate source, Engram): one-shot
prefill = chunked prefill = token-by-token decode = multi-token decode, in logits and in what each
path leaves in the cache, with and without a DSpark draft attached (whose capture rings the forward
writes), and after steps whose rejected drafts are rewritten from an earlier position."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from multi_decode_steps import multi_step
from v41_helpers import run_chunks, tiny_model

from deepinfer.model import DeepseekV41ForCausalLM, DSparkDraft, ForwardBatch, ModelCache

ATOL = 5e-4          # as test_v41_model: summation order differs, a rounding tie of the packed caches may flip
K = 3                # drafts per row: rows feed 1 … K + 1 query tokens
BLOCK = 8
NUM_ROWS = 4
BLOCKS_PER_ROW = 12
SLOTS = [1 + i for i in range(NUM_ROWS)]
DSPARK = {"dspark_block_size": K, "dspark_noise_token_id": 95, "dspark_markov_rank": 8,
          "dspark_n_routed_experts": 3, "dspark_num_experts_per_tok": 2}
# (draft attached, spare ring rows): the tightest rings multi-token decode takes (K = max_query_len − 1),
# and the draft head's K + 1
SETUPS = [pytest.param(False, K, id="rings-tight"), pytest.param(True, K + 1, id="draft")]


@pytest.fixture(scope="module")
def models() -> dict[bool, DeepseekV41ForCausalLM]:
    plain = tiny_model(seed=3, **DSPARK)
    drafted = tiny_model(seed=3, **DSPARK)
    draft = DSparkDraft(drafted, 2)
    draft.init_weights(5, std=0.1)
    drafted.attach_draft(draft.eval())
    return {False: plain, True: drafted}


def _tables() -> list[list[int]]:
    """Row i owns blocks 1 + 12·i … in reverse order (non-contiguous tables)."""
    return [list(range(1 + i * BLOCKS_PER_ROW, 1 + (i + 1) * BLOCKS_PER_ROW))[::-1] for i in range(NUM_ROWS)]


def _cache(model: DeepseekV41ForCausalLM, backtrack: int) -> ModelCache:
    return ModelCache.allocate(model.cache_spec(BLOCK, backtrack), 1 + NUM_ROWS * BLOCKS_PER_ROW, NUM_ROWS + 1)


def _per_sequence(model, cache, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
    """The per-sequence path over one chunk per row (rows of one token are forced onto it too)."""
    batch = ForwardBatch.build(chunks, starts, _tables()[: len(chunks)], SLOTS[: len(chunks)], logits="all")
    with torch.no_grad():
        return model(dataclasses.replace(batch, uniform_decode=False), cache)


def _token_by_token(model, cache, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
    """Plain decoding: one token per row and step (the batched one-token path); logits row by row."""
    out: list[list[torch.Tensor]] = [[] for _ in chunks]
    tables = _tables()
    for j in range(max(map(len, chunks))):
        rows = [i for i, c in enumerate(chunks) if j < len(c)]
        batch = ForwardBatch.decode(np.array([chunks[i][j] for i in rows]), np.array([starts[i] + j + 1 for i in rows]),
                                    np.array([tables[i] for i in rows]), np.array([SLOTS[i] for i in rows]))
        with torch.no_grad():
            logits = model(batch, cache)
        for k, i in enumerate(rows):
            out[i].append(logits[k])
    return torch.stack([t for row in out for t in row])


def _multi(model, cache, chunks: list[list[int]], starts: list[int], order: np.ndarray | None = None,
           pad: int = 0, max_query_len: int = K + 1) -> torch.Tensor:
    """`multi_decode_steps.multi_step` over this module's block tables and slots."""
    return multi_step(model, cache, chunks, starts, np.array(_tables()), SLOTS, max_query_len=max_query_len,
                      order=order, pad=pad)


def _prefill(model, cache, prompts: list[list[int]]) -> None:
    _per_sequence(model, cache, prompts, [0] * len(prompts))


def _copy(cache: ModelCache) -> ModelCache:
    return ModelCache(cache.spec, {k: v.clone() for k, v in cache.paged.items()},
                      {k: v.clone() for k, v in cache.state.items()})


def _same_cache(got: ModelCache, want: ModelCache) -> None:
    """The same state and paged rows outside the dummy slot 0 and the reserved block 0 (packed rows
    decoded: their bytes re-round alike, float32 sums in another order differ in the last bits)."""
    for name, rows in want.state.items():
        a, b = got.state[name][1:], rows[1:]
        if a.dtype == torch.int64:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(_decoded(a), _decoded(b), atol=ATOL, rtol=0, msg=name)
    for name, rows in want.paged.items():
        torch.testing.assert_close(_decoded(got.paged[name][1:]), _decoded(rows[1:]), atol=ATOL, rtol=0, msg=name)


def _decoded(rows: torch.Tensor) -> torch.Tensor:
    """Packed rows (uint8) as the floats they hold, one value per byte group; other rows as they are."""
    if rows.dtype != torch.uint8:
        return rows.float()
    from deepinfer.kernels.reference.v41_quant import dequant_fp4_rows, dequant_mxfp8_rows
    width = rows.shape[-1]
    if width % 33 == 0:                                   # MXFP8: dim bytes + dim / 32 scales
        return dequant_mxfp8_rows(rows, width // 33 * 32)
    for dim, e4m3 in ((width * 16 // 9, True), (width * 32 // 17, False)):   # FP4 + e4m3 / 16, FP4 + ue8m0 / 32
        if dim // 2 + dim // (16 if e4m3 else 32) == width:
            return dequant_fp4_rows(rows, dim, e4m3_scales=e4m3)
    raise AssertionError(f"unknown packed row width {width}")


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 95, n).tolist()


@pytest.mark.parametrize(("drafted", "backtrack"), SETUPS)
def test_a_mixed_step_equals_token_by_token_and_per_sequence_decoding(models, drafted, backtrack) -> None:
    """Rows of 1 … K + 1 tokens in shuffled order plus a padding token, after prefills that leave
    every row at another phase of the ratio-2 groups, the candidate blocks and the window ring: ratio-2
    groups close inside the step, the Engram look-back reaches tokens of the same step, and the rings
    wrap."""
    model = models[drafted]
    rng = np.random.default_rng(1)
    prompts = [_tokens(rng, n) for n in (1, 10, 19, 26)]
    starts = [len(p) for p in prompts]
    chunks = [_tokens(rng, q) for q in (K + 1, 1, 3, 2)]
    caches = [_cache(model, backtrack) for _ in range(3)]
    for cache in caches:
        _prefill(model, cache, prompts)
    got = _multi(model, caches[0], chunks, starts, order=rng.permutation(sum(map(len, chunks))), pad=1)
    token_by_token = _token_by_token(model, caches[1], chunks, starts)
    per_sequence = _per_sequence(model, caches[2], chunks, starts)
    torch.testing.assert_close(got, token_by_token, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, per_sequence, atol=ATOL, rtol=0)
    _same_cache(caches[0], caches[1])
    _same_cache(caches[0], caches[2])


def test_multi_token_decode_steps_equal_one_shot_prefill(models) -> None:
    """Issue #19's chain's last link: a prefill, then steps of 1 … K + 1 tokens of one row (at
    every phase of the groups) give the one-shot prefill's logits (the other links: test_v41_model)."""
    model = models[False]
    tokens = torch.randint(3, 95, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    one_shot = run_chunks(model, [tokens], [[37]], backtracking=K)[0]
    cache = _cache(model, K)
    _prefill(model, cache, [tokens[:6]])
    got, start = [], 6
    for q in (4, 1, 3, 2, 4, 4, 2, 1, 3, 4, 3):
        got.append(_multi(model, cache, [tokens[start:start + q]], [start]))
        start += q
    assert start == 37
    torch.testing.assert_close(torch.cat(got), one_shot[6:], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("drafted", "backtrack"), SETUPS)
def test_rejected_drafts_are_rewritten_and_decoding_goes_on_as_plain_decoding(models, drafted, backtrack) -> None:
    """Speculative decoding's pattern: each step feeds [anchor, drafts] per row, keeps a random prefix
    and starts the next step after it, so the rejected positions (ring rows, compressor rows, Engram
    ids, closed entries, draft capture rows) are rewritten from an earlier position. Every step equals
    the per-sequence path taking the same steps, and a fresh cache prefilled with the committed
    history, then fed the step's tokens in one chunk or one at a time (plain decoding); with a draft
    attached its proposals from the two caches agree too.

    One-token steps are held to 1e-3 and the same greedy tokens: on the same cache, the one-token path
    and the per-sequence path alone (no multi-token step involved) sometimes round a window row to
    MXFP8 one step apart (a float32 value on a rounding boundary): up to 3.4e-4 in these logits."""
    model = models[drafted]
    rng = np.random.default_rng(7)
    history = [_tokens(rng, n) for n in (4, 9, 15, 22)]
    cache, same_steps = _cache(model, backtrack), _cache(model, backtrack)
    _prefill(model, cache, history)
    _prefill(model, same_steps, history)
    # The first steps reject every draft of their K + 1-token rows: the next step starts one position
    # later, the furthest any rejected row reaches past it (what sizes the rings).
    fixed = [([K + 1, 1, 3, 2], [1, 1, 2, 1]), ([K + 1, K + 1, 2, K + 1], [1, 2, 2, K + 1])]
    for step in range(7):
        lens, keeps = fixed[step] if step < len(fixed) else (rng.integers(1, K + 2, NUM_ROWS).tolist(), None)
        chunks = [_tokens(rng, q) for q in lens]
        starts = [len(h) for h in history]
        got = _multi(model, cache, chunks, starts, order=rng.permutation(sum(lens)), pad=step % 2)
        torch.testing.assert_close(got, _per_sequence(model, same_steps, chunks, starts), atol=ATOL, rtol=0)
        fresh = _cache(model, backtrack)
        _prefill(model, fresh, history)
        plain = _copy(fresh)
        torch.testing.assert_close(got, _per_sequence(model, fresh, chunks, starts), atol=ATOL, rtol=0)
        plain_logits = _token_by_token(model, plain, chunks, starts)
        torch.testing.assert_close(got, plain_logits, atol=1e-3, rtol=0)
        assert torch.equal(got.argmax(-1), plain_logits.argmax(-1))
        keeps = keeps or [1 + int(rng.integers(0, q)) for q in lens]   # the anchor + accepted drafts
        for h, chunk, keep in zip(history, chunks, keeps):
            h.extend(chunk[:keep])
    assert min(len(h) for h in history) > 8 + backtrack                # every row's rings wrapped
    if drafted:
        plain = _cache(model, backtrack)
        _prefill(model, plain, history)
        anchors, positions = torch.tensor(_tokens(rng, NUM_ROWS)), torch.tensor([len(h) for h in history])
        want = model.draft.propose(anchors, positions, torch.tensor(SLOTS), plain)
        got = model.draft.propose(anchors, positions, torch.tensor(SLOTS), cache)
        assert torch.equal(got.token_ids, want.token_ids)
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)


def test_one_token_rows_equal_the_one_token_decode_bitwise(models) -> None:
    model = models[True]
    rng = np.random.default_rng(2)
    prompts = [_tokens(rng, n) for n in (5, 8, 13, 21)]
    tokens = [[t] for t in _tokens(rng, NUM_ROWS)]
    starts = [len(p) for p in prompts]
    results = []
    for max_query_len in (None, 1, K + 1):
        cache = _cache(model, K + 1)
        _prefill(model, cache, prompts)
        if max_query_len is None:
            results.append(_token_by_token(model, cache, tokens, starts))
        else:
            results.append(_multi(model, cache, tokens, starts, max_query_len=max_query_len))
    assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0])


def test_rings_too_short_for_the_query_length_are_refused_before_anything_is_written(models) -> None:
    model = models[False]
    cache = _cache(model, K - 1)
    _prefill(model, cache, [[5, 6, 7]])
    before = {name: t.clone() for name, t in cache.state.items()}
    refused = r"layers\.0\.window: .* \(needs 8 \+ 3: cache_spec\(max_backtracking >= 3\)\)"
    with pytest.raises(ValueError, match=refused):
        _multi(model, cache, [[8, 9, 10, 11]], [3], max_query_len=K + 1)
    assert all(torch.equal(cache.state[name], t) for name, t in before.items())
    _multi(model, cache, [[8, 9, 10]], [3], max_query_len=K)        # K − 1 spare rows hold K tokens


def test_an_engram_history_ring_too_short_is_named() -> None:
    """Every ring is checked by its own span (here only the Engram history is short)."""
    from deepinfer.model.layers import csa2_decode
    from deepinfer.model.layers.engram import HISTORY

    model = tiny_model(seed=0)
    spec = model.cache_spec(BLOCK, K)
    short = dataclasses.replace(spec, states=tuple(dataclasses.replace(s, shape=(s.shape[0] - 1,)) if s.name == HISTORY
                                                   else s for s in spec.states))
    with pytest.raises(ValueError, match=r"engram\.history: a ring of 4 rows .* \(needs 2 \+ 3"):
        csa2_decode.check_rings(model.cfg, ModelCache.allocate(short, 2, 2), K + 1)
    csa2_decode.check_rings(model.cfg, ModelCache.allocate(spec, 2, 2), K + 1)
