"""greedy_verify_flat: the forward's token order gives greedy_verify's tokens, padding ignored."""

import torch

from deepinfer.spec import gather_verify_logits, greedy_verify, greedy_verify_flat

K, VOCAB = 4, 7


def _case(seed: int, num_rows: int, num_padding: int):
    gen = torch.Generator().manual_seed(seed)
    query_lens = torch.randint(1, K + 2, (num_rows,), generator=gen)
    total = int(query_lens.sum())
    logits = torch.randn(total + num_padding, VOCAB, generator=gen)
    best = logits.argmax(-1)
    token_rows = torch.repeat_interleave(torch.arange(num_rows), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    columns = torch.arange(total) - starts[token_rows]
    # drafts: the target's argmax at the position before, with some made wrong
    fed = torch.empty(total, dtype=torch.int64)
    fed[columns == 0] = torch.randint(0, VOCAB, (num_rows,), generator=gen)
    later = torch.nonzero(columns > 0).squeeze(1)
    wrong = torch.rand(len(later), generator=gen) < 0.3
    fed[later] = torch.where(wrong, (best[later - 1] + 1) % VOCAB, best[later - 1])
    pad_rows = torch.full((num_padding,), num_rows)
    return (logits, torch.cat((fed, torch.zeros(num_padding, dtype=torch.int64))),
            torch.cat((token_rows, pad_rows)), torch.cat((columns, torch.zeros(num_padding, dtype=torch.int64))),
            query_lens, total)


def test_flat_greedy_verification_equals_greedy_verify() -> None:
    for seed in range(6):
        logits, fed, token_rows, columns, query_lens, total = _case(seed, num_rows=5, num_padding=3)
        flat = greedy_verify_flat(logits, fed, token_rows, columns, 5, K, 1e33)
        drafts = torch.zeros(5, K, dtype=torch.int64)
        for t in range(total):
            if columns[t] > 0:
                drafts[token_rows[t], columns[t] - 1] = fed[t]
        packed = gather_verify_logits(logits[:total], query_lens, K + 1)
        want = greedy_verify(packed, drafts, query_lens - 1)
        assert torch.equal(flat.num_accepted, want.num_accepted)
        assert torch.equal(flat.output_ids, want.output_ids)
        assert flat.finite.all()


def test_rows_without_tokens_accept_nothing_and_non_finite_rows_are_flagged() -> None:
    logits, fed, token_rows, columns, _, total = _case(7, num_rows=3, num_padding=2)
    logits[total - 1, 2] = float("nan")                       # the last real row
    flat = greedy_verify_flat(logits, fed, token_rows, columns, 5, K, 1e33)   # rows 3 and 4: none of its tokens
    assert flat.finite.tolist() == [True, True, False, True, True]
    assert flat.num_accepted[3:].tolist() == [0, 0]
