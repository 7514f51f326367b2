"""The embedded model's shipped DSpark draft head (`mtp.safetensors`, tools/train_tiny/train_draft.py)
drafts for real: on held-out standard-library code its greedy drafts are accepted often enough to
pass MIN_MEAN_ACCEPTED_LENGTH tokens per verify step, and speculation changes no output token."""

from __future__ import annotations

import pytest
from heldout import heldout_code

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.bench import run_bench
from deepinfer.model import num_stages_in

ENGINE = {"device": "cpu", "kv_cache_memory_mb": 16, "max_num_seqs": 4, "max_model_len": 512}
MAX_TOKENS = 64
MIN_MEAN_ACCEPTED_LENGTH = 1.9      # measured 2.13 on these two prompts (72 of 320 drafts accepted, 64 rows)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_shipped_head_is_accepted_and_keeps_the_greedy_tokens() -> None:
    prompts, params = heldout_code(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    speculative = LLM(num_speculative_tokens=5, varlen_verify=False, **ENGINE)    # no model: the embedded default
    assert num_stages_in(speculative.engine.model.draft_weights) == 1
    got = speculative.generate(prompts, params, use_tqdm=False)
    want = LLM(**ENGINE).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = speculative.engine.stats()
    assert stats.mean_accepted_length >= MIN_MEAN_ACCEPTED_LENGTH, stats
    # `deepinfer bench` reports the mean accepted length of its timed requests (random token prompts:
    # few drafts accepted, but every verified row gives at least the target's own token)
    result = run_bench(speculative.engine, num_prompts=2, input_len=16, output_len=12)
    assert result["spec_draft_tokens"] > 0 and result["spec_verify_steps"] > 0
    assert 1.0 <= result["spec_mean_accepted_length"] <= 1 + speculative.engine.spec.k
    assert "spec_mean_accepted_length" not in run_bench(LLM(**ENGINE).engine, num_prompts=1, input_len=8,
                                                        output_len=4)
