"""deepinfer.spec — speculative decoding: verification and the varlen verify-length policy.

The engine's speculative decode steps (`deepinfer.engine.speculative.spec_step`) use `DraftSampler`, `verify`,
`gather_verify_logits` and the verify policies; the rest is library-only so far (docs/spec.md).

Verification (`verify`, `greedy_verify`): one target forward over [anchor, drafts] → accepted
drafts, the bonus / correction token, logprobs; greedy rows by exact match, sampled rows by
rejection sampling that preserves the target distribution, with noise keyed by (seed, output
position) (`keyed_uniform`) so seeded requests do not depend on their batch. `DraftSampler` is the
matching sampler for the drafter (`deepinfer.model.DSparkDraft.propose`). `cut_accepted_run` cuts an
accepted run at EOS / stop ids / max_tokens.

Varlen verify (docs/design.md §7.2): `profile_step_times` + `ProfileCache` (startup curve per graph size,
cached in JSON keyed by `profile_key`), `ForwardRuntimeEstimator`, `SamplerRuntimeEstimator`,
`DraftRuntimeEstimator` (the draft walk's cost per drafting row count), `drafting_can_pay`,
`choose_query_lens` / `VarlenVerifyPolicy` and `FixedVerifyPolicy` (both satisfy deepinfer.sched's
`VerifyLengthPolicy` structurally), `query_lens_by_confidence` (the on-device split), and
`cuda_graph_key` / `cuda_graph_sizes` (graph sizes keyed by total query tokens).
"""

from importlib.metadata import version as _version

from .draft_sampling import DraftSampler
from .estimators import DraftRuntimeEstimator, ForwardRuntimeEstimator, SamplerRuntimeEstimator
from .graph_sizes import DEFAULT_GRAPH_INTERVAL, cuda_graph_key, cuda_graph_keys, cuda_graph_sizes
from .keyed_noise import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    keyed_uniform,
    sample_from_probs,
    seed_to_int64,
)
from .profile import ProfileCache, StepTimeCurve, profile_key, profile_step_times, trimmed_mean
from .stop import FINISH_LENGTH, FINISH_STOP, AcceptedRun, cut_accepted_run
from .varlen import (
    AcceptanceCalibration,
    FixedVerifyPolicy,
    VarlenPlan,
    VarlenVerifyPolicy,
    choose_query_lens,
    drafting_can_pay,
    query_lens_by_confidence,
)
from .verify import VerifyInput, VerifyResult, gather_verify_logits, greedy_verify, verify

__version__ = _version("deepinfer-spec")
__all__ = [
    "AcceptanceCalibration",
    "DEFAULT_GRAPH_INTERVAL",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_SAMPLE",
    "AcceptedRun",
    "DraftRuntimeEstimator",
    "DraftSampler",
    "FixedVerifyPolicy",
    "ForwardRuntimeEstimator",
    "ProfileCache",
    "SamplerRuntimeEstimator",
    "StepTimeCurve",
    "VarlenPlan",
    "VarlenVerifyPolicy",
    "VerifyInput",
    "VerifyResult",
    "choose_query_lens",
    "cuda_graph_key",
    "cuda_graph_keys",
    "cuda_graph_sizes",
    "cut_accepted_run",
    "drafting_can_pay",
    "gather_verify_logits",
    "greedy_verify",
    "keyed_uniform",
    "profile_key",
    "profile_step_times",
    "query_lens_by_confidence",
    "sample_from_probs",
    "seed_to_int64",
    "trimmed_mean",
    "verify",
]
