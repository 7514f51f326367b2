"""Engine configuration: `EngineArgs` and its checks, where the model comes from (`model_source`), the
environment variables read for tuning and debugging (`env`, the only reader of them) and the argparse
flags made from dataclasses (`dataclass_flags`). The bottom layer of the engine package.
"""
