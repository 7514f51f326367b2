"""deepinfer.model — the DeepSeek-V4 model runtime.

Config (`DeepseekV4Config`), safetensors loading with FP8 / MXFP4 dequantisation (`load_model`),
the model over a packed variable-length batch (`DeepseekV4ForCausalLM`, `ForwardBatch`) and its cache
(`CacheSpec` declares paged streams and per-sequence state; `ModelCache` holds the tensor views), and
the embedded default: a tiny V4 trained on Python source, shipped inside this package
(`embedded_model_dir()`; model card in its README.md).
"""

from importlib.metadata import version as _version

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, PagedStreamSpec, StateSpec
from .config import ConfigError, DeepseekV4Config, QuantConfig
from .embedded import embedded_model_dir
from .model import DeepseekV4ForCausalLM
from .weights import LoadedWeights, WeightError, load_model, load_weights

__version__ = _version("deepinfer-model")
__all__ = [
    "CacheSpec",
    "ConfigError",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "ForwardBatch",
    "LoadedWeights",
    "ModelCache",
    "PagedStreamSpec",
    "QuantConfig",
    "StateSpec",
    "WeightError",
    "embedded_model_dir",
    "load_model",
    "load_weights",
]
