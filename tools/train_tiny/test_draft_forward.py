"""The training forward (`draft_forward`) drafts what the engine's `DSparkDraft.propose` drafts.

    .venv/bin/python -m pytest tools/train_tiny/test_draft_forward.py
"""

from __future__ import annotations

import pytest
import torch
from draft_data import FeatureRecorder
from draft_forward import context_keys, draft_forward

from deepinfer.model import DSparkDraft, ForwardBatch, ModelCache, embedded_model_dir, load_model

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_training_forward_matches_propose() -> None:
    """A random head (so the Markov and confidence parts matter): prompts shorter and longer than the
    window, each anchored on the target's greedy token after the prompt."""
    model = load_model(embedded_model_dir(), dtype=torch.float32, device="cpu")
    draft = DSparkDraft(model, 1)
    draft.init_weights(3, std=0.05)
    prompts = [list(range(10, 50)), [(7 * i) % 3000 + 20 for i in range(100)]]
    tables = [list(range(1, 8)), list(range(8, 15))]
    recorder = FeatureRecorder()
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), 16, 3)
    model.attach_draft(recorder)
    with torch.no_grad():
        anchors = model(ForwardBatch.build(prompts, [0, 0], tables, [1, 2], logits="last"), cache).argmax(-1)
    features = torch.zeros(2, 100, recorder.features[0].shape[-1])
    features[0, :40], features[1] = recorder.features[0][:40], recorder.features[0][40:]
    model.attach_draft(draft)
    with torch.no_grad():
        cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE, max_backtracking=6), 16, 3)
        model(ForwardBatch.build(prompts, [0, 0], tables, [1, 2]), cache)
        positions = torch.tensor([40, 100])
        proposal = draft.propose(anchors, positions, torch.tensor([1, 2]), cache)
        prev_ids = torch.cat((anchors[:, None], proposal.token_ids[:, :-1]), dim=1)
        out = draft_forward(draft, context_keys(draft, features), torch.tensor([0, 1]), positions, anchors, prev_ids)
    model.attach_draft(None)
    torch.testing.assert_close(out.logits, proposal.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.sigmoid(out.confidence_logits), proposal.confidence, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.logits.argmax(-1), proposal.token_ids)
