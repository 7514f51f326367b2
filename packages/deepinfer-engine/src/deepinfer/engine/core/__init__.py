"""The step machinery under `LLMEngine`: request intake and state (`intake`, `request`, `outputs`,
`stats`), the Step protocol and the plain step (`steps`, `plain_step`, `decode_rows`), the model runner
with its block tables and CUDA graphs (`model_runner`, `block_tables`, `cuda_graphs`) and prefix caching
(`prefix_caching`). docs/design.md §1-§5.
"""
