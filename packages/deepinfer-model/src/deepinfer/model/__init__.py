"""deepinfer.model — the DeepSeek-V4 and DeepSeek-V4.1 model runtime.

Config (`DeepseekV4Config`), safetensors loading tensor by tensor with FP8 / MXFP4 dequantisation and
name / shape / dtype / finiteness checks (`load_model`), or seeded random weights of the real shapes
from config.json alone (`load_model(..., load_format="dummy")`, `dummy_model`),
the model over a packed variable-length batch (`DeepseekV4ForCausalLM`, `ForwardBatch`) and its cache
(`CacheSpec` declares paged streams and per-sequence state; `ModelCache` holds the tensor views), and
the embedded default: a tiny V4 trained on Python source, shipped inside this package
(`embedded_model_dir()`; model card in its README.md).

DeepSeek-V4.1 (`DeepseekV41Config`, `DeepseekV41ForCausalLM`): `DeepseekV4Config.from_dict` /
`from_model_dir` return a `DeepseekV41Config` for a V4.1 config.json (composite `deepseek_v41` or flat
`deepseek_v41_text`), and `load_model` builds the V4.1 model from it, with the Engram token map taken
from the folder's tokenizer.json (`compressed_token_map`). Neither model class derives from the other:
both satisfy the `CausalLM` protocol, what the engine drives; `DraftHead` is what a model needs of
the draft head attached to it (`DSparkDraft`).

Expert parallelism (`apply_expert_parallel`, `ExpertSlots`, `run_ep_dummy_forward`,
`take_expert_counts`, `move_experts`): the routed experts of every MoE layer sharded over a
torch.distributed group, tokens dispatched and combined by all-to-all (layers/moe_ep.py): variable
splits in prefill; in decode steps (`ForwardBatch.decode_step`), fixed-capacity buffers with equal
splits and no host read (layers/moe_ep_fixed.py), so a decode step can be captured in a CUDA graph
(not yet run on GPUs).
"""

from importlib.metadata import version as _version

from .batch import ForwardBatch
from .cache import CacheSpec, ModelCache, PagedStreamSpec, StateSpec
from .causal_lm import CausalLM, DraftHead
from .config import ConfigError, DeepseekV4Config, QuantConfig
from .config_v41 import DeepseekV41Config
from .dspark import DraftProposal, DSparkDraft, num_stages_in
from .dummy import dummy_model
from .embedded import embedded_model_dir
from .layers.moe_ep import ExpertParallel, ExpertSlots
from .layers.moe_ep_moves import ExpertMoves, move_experts
from .layers.moe_ep_setup import apply_expert_parallel, moe_layers, run_ep_dummy_forward, take_expert_counts
from .model import DeepseekV4ForCausalLM
from .model_v41 import DeepseekV41ForCausalLM
from .weights import LOAD_FORMATS, WeightError, load_model

__version__ = _version("deepinfer-model")
__all__ = [
    "LOAD_FORMATS",
    "CacheSpec",
    "CausalLM",
    "ConfigError",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DraftHead",
    "DraftProposal",
    "DSparkDraft",
    "ExpertMoves",
    "ExpertParallel",
    "ExpertSlots",
    "ForwardBatch",
    "ModelCache",
    "PagedStreamSpec",
    "QuantConfig",
    "StateSpec",
    "WeightError",
    "apply_expert_parallel",
    "dummy_model",
    "embedded_model_dir",
    "load_model",
    "moe_layers",
    "move_experts",
    "num_stages_in",
    "run_ep_dummy_forward",
    "take_expert_counts",
]
