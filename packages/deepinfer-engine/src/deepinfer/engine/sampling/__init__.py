"""Sampling: the request parameters (`sampling_params`), the logit controls and the per-step sampling
batch (`logit_controls`, `sampling_batch`), the sampler and its stage in a step (`sampler`,
`sampling_stage`), and structured output (`grammar_backend`, `grammar_compiler`, `token_bitmask`).
"""
