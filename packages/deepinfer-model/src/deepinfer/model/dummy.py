"""Random weights of the real shapes, made on the device: `load_format="dummy"` (as vLLM's dummy format).

A folder holding only config.json is enough: the model is allocated on the target device
(`build_model`) and every parameter and buffer is filled there from a seeded generator, so a model
of full size can run through the engine, and be benchmarked, without its checkpoint; nothing of
the weights' size passes through host memory. The values keep a forward finite over many layers
(each projection maps inputs of RMS 1 to outputs of RMS about 0.58, norms are near 1) and keep
every integer and quantised tensor valid (hash-routing ids in range, FP8 / MXFP4 codes and scales
that dequantise to finite values).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

from .config import DeepseekV4Config
from .config_v41 import DeepseekV41Config
from .layers.moe import Experts
from .model import DeepseekV4ForCausalLM, build_model
from .model_v41 import DeepseekV41ForCausalLM, build_model_v41

__all__ = ["dummy_model"]

NEAR_ONE = 0.1            # norm weights and mHC scales: uniform in 1 ± this
SMALL_BIAS = 0.1          # mHC bases, attention sinks, compressor position biases: uniform in ± this
ROUTER_BIAS = 0.01        # learned routers' selection bias: uniform in ± this
_TABLE_ROWS = 4096        # hash-table rows drawn at a time (a [rows, n_routed_experts] float32 temporary)


def dummy_model(
    cfg: DeepseekV4Config | DeepseekV41Config,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_quant: bool = False,
    expert_dtype: str | None = None,
    seed: int = 0,
    engram_on_host: bool = False,
) -> DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """A model of `cfg`'s shapes with seeded random weights, built and filled on `device`.

    Each tensor is drawn from its own generator, seeded by (`seed`, its name), so a tensor's values
    do not depend on the others (the dense weights of a model are the same whatever its
    `expert_dtype`):
    - matrices (projections, embedding, LM head, mHC projections, float routed experts): uniform in
      ±1/sqrt(fan_in), fan_in = the last dimension (torch's default bound for `nn.Linear`);
    - FP8 / MXFP4 routed experts (`expert_dtype`): such matrices quantised expert by expert on the
      device (`Experts.quantise_`): valid e4m3 / e2m1 codes, finite scales;
    - RMSNorm weights and mHC scales: uniform in 1 ± NEAR_ONE; mHC bases, attention sinks and
      compressor position biases: ± SMALL_BIAS; learned routers' bias: ± ROUTER_BIAS;
    - the hash-routing table `tid2eid` [vocab, top_k]: top_k distinct expert ids per token;
    - the RoPE frequency buffers: computed from the config as for any model.

    Args:
        cfg: the model config (e.g. `DeepseekV4Config.from_model_dir` of a folder with only config.json).
        dtype, device, kv_quant, expert_dtype: as `load_model`.
        seed: any int >= 0; the same seed on the same device type gives bitwise the same weights
            (CPU and CUDA generators draw different values).

    Returns:
        The model in eval mode; `draft_weights` is empty (no draft head is made up).

    Raises:
        ValueError: `dtype` is not float32, bfloat16 or float16, or `seed` < 0.
        ConfigError: `expert_dtype` does not fit the config's sizes (see `layers.moe.Experts`).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} must be torch.float32, torch.bfloat16 or torch.float16")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    if isinstance(cfg, DeepseekV41Config):
        return _dummy_v41(cfg, dtype, device, expert_dtype, seed, engram_on_host)
    model = build_model(cfg, device=device, dtype=dtype, kv_quant=kv_quant, expert_dtype=expert_dtype)
    gen = torch.Generator(device=torch.device(device))
    with torch.no_grad():
        quantised: set[str] = set()
        for prefix, module in model.named_modules():
            if isinstance(module, Experts) and module.expert_dtype is not None:
                _quantised_experts(module, cfg, gen, _seed(seed, f"{prefix}.w13"), _seed(seed, f"{prefix}.w2"))
                quantised.update(f"{prefix}.{name}" for name in ("w13", "w2", "w13_scale", "w2_scale"))
        for name, param in model.named_parameters():
            if name not in quantised:
                _fill_parameter(name, param, gen.manual_seed(_seed(seed, name)))
        for name, buffer in model.named_buffers():
            if name.endswith(".tid2eid"):
                _hash_table(buffer, cfg.n_routed_experts, gen.manual_seed(_seed(seed, name)))
            elif not name.endswith("inv_freq"):                 # RoPE frequencies: set by build_model
                raise RuntimeError(f"dummy_model has no rule for buffer {name!r}")
    return model.eval()


def _seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1                 # a non-negative int64


def _fill_parameter(name: str, param: Tensor, gen: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name or leaf.endswith("_scale"):               # RMSNorm weights, hc_*_scale
        param.uniform_(1.0 - NEAR_ONE, 1.0 + NEAR_ONE, generator=gen)
    elif leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
        param.uniform_(-SMALL_BIAS, SMALL_BIAS, generator=gen)
    elif name.endswith(".gate.bias"):
        param.uniform_(-ROUTER_BIAS, ROUTER_BIAS, generator=gen)
    elif param.dim() >= 2 and param.dtype.is_floating_point:
        bound = 1.0 / math.sqrt(param.shape[-1])
        param.uniform_(-bound, bound, generator=gen)
    else:
        raise RuntimeError(f"dummy_model has no rule for parameter {name!r} {tuple(param.shape)} {param.dtype}")


def _quantised_experts(experts: Experts, cfg: DeepseekV4Config, gen: torch.Generator, seed_w13: int,
                       seed_w2: int) -> None:
    """Random float expert matrices, quantised one expert at a time (one expert's float32 temporary)."""
    num_experts, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    device = experts.w13.device
    gen_w2 = torch.Generator(device=device).manual_seed(seed_w2)
    gen.manual_seed(seed_w13)
    bound13, bound2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(inter)
    for expert in range(num_experts):
        w13 = torch.empty(2 * inter, hidden, device=device).uniform_(-bound13, bound13, generator=gen)
        w2 = torch.empty(hidden, inter, device=device).uniform_(-bound2, bound2, generator=gen_w2)
        experts.quantise_(expert, w13, w2)


def _hash_table(table: Tensor, num_experts: int, gen: torch.Generator) -> None:
    """`table` [vocab, top_k] int64 ← top_k distinct expert ids per row, uniformly drawn."""
    vocab, top_k = table.shape
    for start in range(0, vocab, _TABLE_ROWS):
        rows = min(_TABLE_ROWS, vocab - start)
        keys = torch.rand(rows, num_experts, generator=gen, device=table.device)
        table[start:start + rows] = keys.topk(top_k, dim=1).indices


def _dummy_v41(cfg: DeepseekV41Config, dtype: torch.dtype, device: torch.device | str, expert_dtype: str | None,
               seed: int, engram_on_host: bool) -> DeepseekV41ForCausalLM:
    """A DeepSeek-V4.1 model with `DeepseekV41ForCausalLM.init_weights(seed)` weights (normal(0, 0.02)
    matrices, unit norms and mHC scales, zero biases, sinks and mHC bases) and, no tokenizer being
    read, the Engram token map `token id mod engram_compressed_vocab_size`."""
    model = build_model_v41(cfg, device=device, dtype=dtype, expert_dtype=expert_dtype, engram_on_host=engram_on_host)
    model.init_weights(seed)
    if cfg.engram_layer_ids:
        model.bind_token_map(torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)
    model.place_engram_tables()
    return model.eval()
