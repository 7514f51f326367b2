"""deepinfer.spec's verify-length policies satisfy deepinfer.sched's Protocol (structurally: spec
never imports sched) and their answers pass the scheduler's own check."""

import numpy as np

from deepinfer.sched.verify import VerifyLengthPolicy, checked_query_lens
from deepinfer.spec import (
    FixedVerifyPolicy,
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    StepTimeCurve,
    VarlenVerifyPolicy,
)


def test_spec_policies_are_scheduler_verify_policies() -> None:
    varlen = VarlenVerifyPolicy(ForwardRuntimeEstimator(StepTimeCurve((1, 8, 64), (5.0, 5.5, 30.0))),
                                SamplerRuntimeEstimator())
    seq_ids, seq_lens = ("x", "y", "z"), np.array([30, 20, 10], dtype=np.int32)
    for policy in (varlen, FixedVerifyPolicy()):
        assert isinstance(policy, VerifyLengthPolicy)
        lens = checked_query_lens(policy.query_lens(seq_ids, seq_lens, 6), 3, 6)
        assert lens.shape == (3,)
