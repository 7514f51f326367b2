"""deepinfer.model — the DeepSeek-V4 model runtime.

Config (`DeepseekV4Config`), safetensors loading tensor by tensor with FP8 / MXFP4 dequantisation and
name / shape / dtype / finiteness checks (`load_model`), or seeded random weights of the real shapes
from config.json alone (`load_model(..., load_format="dummy")`, `dummy_model`),
the model over a packed variable-length batch (`DeepseekV4ForCausalLM`, `ForwardBatch`) and its cache
(`CacheSpec` declares paged streams and per-sequence state; `ModelCache` holds the tensor views), and
the embedded default: a tiny V4 trained on Python source, shipped inside this package
(`embedded_model_dir()`; model card in its README.md).
"""

from importlib.metadata import version as _version

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, PagedStreamSpec, StateSpec
from .config import ConfigError, DeepseekV4Config, QuantConfig
from .dummy import dummy_model
from .embedded import embedded_model_dir
from .model import DeepseekV4ForCausalLM
from .weights import LOAD_FORMATS, WeightError, load_model

__version__ = _version("deepinfer-model")
__all__ = [
    "LOAD_FORMATS",
    "CacheSpec",
    "ConfigError",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "ForwardBatch",
    "ModelCache",
    "PagedStreamSpec",
    "QuantConfig",
    "StateSpec",
    "WeightError",
    "dummy_model",
    "embedded_model_dir",
    "load_model",
]
