"""The fronts that drive `LLMEngine` through the one core loop (`core_loop`): `AsyncLLM` (a thread),
`AsyncLLMProcess` over the engine process (`engine_process`), and what the streaming fronts share
(`async_front`).
"""
