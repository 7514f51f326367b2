"""The library pieces in the loop the engine will run: DSpark proposals, one verify forward over
[anchor, drafts], verification, and the next anchor — greedy output equals plain greedy decoding,
with a random (poorly accepting) draft head, through a compressing layer and ring wrap-around."""

from __future__ import annotations

import torch

from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM, DSparkDraft, ForwardBatch, ModelCache
from deepinfer.spec import DraftSampler, VerifyInput, gather_verify_logits, greedy_verify, verify

RAW = {
    "vocab_size": 48, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8,
    "compress_ratios": [0, 4, 0], "index_n_heads": 2, "index_head_dim": 8, "index_topk": 64,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
    "num_hash_layers": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3, "max_position_embeddings": 256,
    "dspark_block_size": 3, "dspark_noise_token_id": 47, "dspark_target_layer_ids": [1, 2], "dspark_markov_rank": 8,
}
K = 3
PROMPTS = [[5, 9, 2, 17, 33, 8, 41], [3, 3, 14, 25, 6]]
TABLES = [list(range(1, 9)), list(range(9, 17))]


def _model() -> tuple[DeepseekV4ForCausalLM, DSparkDraft]:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(RAW))
    model.init_weights(4, std=0.2)              # peaked logits, so drafts are sometimes right
    draft = DSparkDraft(model, 2)
    draft.init_weights(5, std=0.2)
    model.attach_draft(draft)
    return model.eval(), draft.eval()


def _plain_greedy(model, num_tokens: int) -> list[list[int]]:
    cache = ModelCache.allocate(model.cache_spec(8, K + 1), 17, 3)
    out = []
    for i, prompt in enumerate(PROMPTS):
        toks, start, feed = [], 0, prompt
        with torch.no_grad():
            while len(toks) < num_tokens:
                logits = model(ForwardBatch.build([feed], [start], [TABLES[i]], [i + 1]), cache)
                start += len(feed)
                feed = [int(logits[0].argmax())]
                toks.append(feed[0])
        out.append(toks)
    return out


def _speculative(model, draft, num_tokens: int, sampler_for=None, oracle=None):
    """Both prompts decoded together; returns tokens per request and the number of verify steps.
    `oracle(outputs)`: a draft sampler that knows the answer (to force acceptances)."""
    cache = ModelCache.allocate(model.cache_spec(8, K + 1), 17, 3)
    slots = torch.tensor([1, 2])
    with torch.no_grad():
        logits = model(ForwardBatch.build(PROMPTS, [0, 0], TABLES, [1, 2]), cache)
    anchors = logits.argmax(-1)
    positions = torch.tensor([len(p) for p in PROMPTS])
    outputs = [[int(a)] for a in anchors]
    steps = 0
    while min(len(o) for o in outputs) < num_tokens:
        sampler = sampler_for(outputs) if sampler_for else None
        pick = sampler or (oracle(outputs) if oracle else None)
        prop = draft.propose(anchors, positions, slots, cache, **({"sample": pick} if pick else {}))
        rows = [[int(anchors[i])] + prop.token_ids[i].tolist() for i in range(2)]
        with torch.no_grad():
            flat = model(ForwardBatch.build(rows, positions.tolist(), TABLES, [1, 2], logits="all"), cache)
        query_lens = torch.full((2,), K + 1)
        target = gather_verify_logits(flat, query_lens, K + 1)
        if sampler is None:
            result = greedy_verify(target, prop.token_ids, query_lens - 1)
        else:
            result = verify(VerifyInput(target, prop.token_ids, query_lens - 1, sampler.temperature,
                                        sampler.draft_probs(prop.logits), sampler.seeds, sampler.output_positions))
        for i in range(2):
            outputs[i].extend(result.output_ids[i, :int(result.num_output[i])].tolist())
        anchors = result.output_ids.gather(1, result.num_accepted[:, None]).squeeze(1)
        positions = positions + result.num_output
        steps += 1
    return [o[:num_tokens] for o in outputs], steps


def test_greedy_speculation_gives_the_plain_greedy_tokens() -> None:
    model, draft = _model()
    want = _plain_greedy(model, 14)
    got, _ = _speculative(model, draft, 14)            # a random draft head: drafts mostly rejected
    assert got == want


def test_accepted_runs_advance_several_positions_and_stay_exact() -> None:
    """Drafts that are right twice, then wrong: every verify step accepts 2 drafts, emits 3 tokens."""
    model, draft = _model()
    want = _plain_greedy(model, 24)

    def oracle(outputs):
        def sample(step: int, logits: torch.Tensor) -> torch.Tensor:
            right = torch.tensor([want[i][len(outputs[i]) + step] for i in range(2)])
            return right if step < 2 else (right + 1) % RAW["vocab_size"]
        return sample

    got, steps = _speculative(model, draft, 22, oracle=oracle)
    assert got == [w[:22] for w in want]
    assert steps == 7                                   # 1 token from prefill + 7 steps x 3 tokens


def test_seeded_sampled_speculation_is_reproducible() -> None:
    model, draft = _model()

    def sampler_for(outputs):
        n = torch.tensor([len(o) for o in outputs])
        return DraftSampler(torch.full((2,), 0.8), torch.tensor([11, 12]), n)

    first, _ = _speculative(model, draft, 10, sampler_for)
    again, _ = _speculative(model, draft, 10, sampler_for)
    assert first == again
