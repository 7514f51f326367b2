"""EngineArgs: every knob of an engine instance, frozen and validated at construction.

The docstring's `Attributes:` section is the one description of each field: the `deepinfer` CLI
builds its engine flags from it and `python -m deepinfer.engine.gen_docs` writes it to
docs/engine_args.md, together with the allowed values below (`allowed_values`).

Construction only checks values; `resolved()` turns the machine- and model-dependent defaults
("auto" device and dtype, the cache budget, a Hugging Face repo id) into concrete ones, as
`LLMEngine` does first thing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import NoReturn

import torch

from deepinfer.sched import EngineType

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERT_DTYPES = ("fp8", "fp4")
LOAD_FORMATS = ("safetensors", "dummy")      # deepinfer.model.LOAD_FORMATS (not imported: the CLI stays light)
MAX_INT32 = 2**31 - 1
AUTO = "auto"
DEFAULT_KV_CACHE_MEMORY_MB = 256.0
DEFAULT_PREFIX_CACHE_HOST_MB = 4096.0     # on CUDA; at most a quarter of the machine's memory
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# 16 TiB: more memory than any one host or GPU has; a larger budget is a typo (MB read as bytes).
MAX_KV_CACHE_MEMORY_MB = 2**24

# Inclusive ranges of the integer fields; a field typed `int | None` takes None as well.
INT_RANGES: dict[str, tuple[int, int]] = {
    "seed": (0, 2**63 - 1),
    "max_model_len": (1, MAX_INT32),
    "block_size": (1, MAX_INT32),
    "num_kv_blocks": (2, MAX_INT32),             # block 0 is reserved
    "max_num_seqs": (1, 2**20),
    "max_num_batched_tokens": (1, MAX_INT32),
    "max_num_prompts": (1, 2**20),
    "prefill_max_sum_seqlen_k": (1, MAX_INT32),
    "data_parallel_size": (1, 1024),
    "eplb_redundant_experts_per_rank": (0, 1024),
    "eplb_window_steps": (1, MAX_INT32),
    "eplb_interval_steps": (1, MAX_INT32),
    "num_speculative_tokens": (0, 64),           # 0 = off; else deepinfer.sched's nextn range
    "yoco_prefill_keep_tokens": (1, MAX_INT32),
    "prefix_cache_snapshots": (1, 2**20),
}
EPLB_PRESETS = ("prefill", "decode")          # docs/design.md §10; deepinfer.eplb's PREFILL / DECODE_EPLB_CONFIG
TRUNCATION_MODES = ("off", "compact", "mask")  # deepinfer.model's ced.TRUNCATION_MODES (not imported, as above)
MAX_DISTRIBUTED_TIMEOUT_S = 86400.0
OPTIONAL_FIELDS = frozenset({"model", "max_model_len", "block_size", "num_kv_blocks", "gpu_memory_utilization",
                             "kv_cache_memory_mb",
                             "max_num_prompts", "prefill_max_sum_seqlen_k", "expert_dtype", "eplb",
                             "eplb_redundant_experts_per_rank", "eplb_window_steps", "eplb_interval_steps",
                             "prefix_cache_snapshots", "prefix_cache_host_mb"})
BOOL_FIELDS = ("stop_preempted_request", "kv_quant", "enforce_eager", "engram_on_host", "batch_invariant",
               "expert_parallel", "varlen_verify", "enable_prefix_caching")


class InvalidEngineArgs(ValueError):
    """An engine argument is out of range; the message names the field and the allowed range.

    Attributes:
        field: the `EngineArgs` field at fault, or None when the error is not about one field.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Engine configuration.

    Attributes:
        model: model folder (config.json, model.safetensors, tokenizer.json), or a Hugging Face repo id
            ("org/name") already in the local Hugging Face cache (read offline, never downloaded);
            None = the embedded default model shipped with deepinfer-model.
        load_format: "safetensors" reads the folder's checkpoint; "dummy" reads config.json alone and
            makes seeded random weights of the real shapes on the device (seed: `seed`), to benchmark
            a model whose checkpoint is not at hand (without tokenizer.json, prompts are token ids).
        device: "cpu", a CUDA device ("cuda", "cuda:1"), or "auto" = "cuda" when torch sees a GPU, else "cpu".
        dtype: compute / weight dtype: "float32", "bfloat16" or "float16"; "auto" = float32 on CPU, and on
            CUDA the config's torch_dtype when it is float16, else bfloat16.
        seed: seeds the sampler's shared generator (requests without their own seed), and the weights
            of load_format="dummy".
        max_model_len: longest sequence (prompt + output); None = min(model limit, 4096).
        block_size: tokens per paged KV block; None = the smallest multiple of every compress ratio ≥ 64.
        num_kv_blocks: paged KV blocks (block 0 included); None = as many as the memory budget holds.
        kv_cache_memory_mb: budget of the cache (paged KV blocks + state slots) in MiB when
            num_kv_blocks is None (CPU, or CUDA without gpu_memory_utilization); None = 256.
        gpu_memory_utilization: on CUDA, size the cache so that weights + cache take this fraction of the
            GPU's memory (activations come out of the rest); None = 0.9 on CUDA when neither
            num_kv_blocks nor kv_cache_memory_mb is set, else use kv_cache_memory_mb.
        max_num_seqs: sequences holding cache at once (one state slot each, × the slot ratio).
        max_num_batched_tokens: prefill tokens per step; longer prompts are chunked.
        max_num_prompts: sequences per prefill step; None = max_num_seqs.
        prefill_max_sum_seqlen_k: bound on the summed K lengths of one prefill step (at least
            max_model_len); None = none.
        chunk_checkpoints: token positions where a chunk may be cut, strictly increasing (empty =
            anywhere).
        stop_preempted_request: finish a preempted request as "preempted" (True) or put it back in
            the queue to be recomputed (False).
        max_cache_usage_for_prefill: a waiting request is prefilled only while the KV blocks in use
            are at most this fraction of the cache (with requests running or not; the rest of a prompt
            already mid-prefill goes on while nothing runs), so that running requests keep room to
            decode (docs/design.md §3.1).
        engine_type: NORMAL, PROMPT (prefill only, disaggregated) or COMPLETION (decode only).
        kv_quant: official FP8/FP4 fake-quantisation of cached KV (off = transformers' numerics).
        expert_dtype: keep the routed experts quantised in memory: "fp8" (e4m3 with float32 block
            scales: half of bf16's bytes) or "fp4" (MXFP4: about a quarter); as stored when the
            checkpoint has them so, else quantised on load; None = the model dtype. Needs the hidden
            and expert sizes divisible by the FP8 block (the checkpoint's, else 128) / by 32.
        enforce_eager: never capture CUDA graphs (decode on CUDA replays graphs keyed by batch size otherwise).
        engram_on_host: a model with Engram layers (DeepSeek-V4.1): keep its Engram tables in host memory
            (pinned on CUDA; the released tables are about 197B parameters) and copy the rows each step
            needs; False = on the device. Refused for a model without Engram layers.
        yoco_prefill_truncation_mode: CED / YOCO prefill truncation of a DeepSeek-V4.1 model: "compact"
            runs the layers from the first KV-consumer layer on for each prompt's last
            yoco_prefill_keep_tokens rows only (the earlier rows still write their window KV; approximate
            by design), "mask" computes the same with every row kept (slower; it checks "compact"); "off"
            = the full model. Refused for a model without KV-consumer layers (DeepSeek-V4), and prompt
            logprobs of a truncated prompt cannot be asked for.
        yoco_prefill_keep_tokens: rows per prompt that truncated prefill computes in full (the window of
            128 plus a backtracking margin by default).
        batch_invariant: batch-invariant kernels (docs/batch_invariance.md): a request's outputs do not
            depend on the other requests of its batch; slower. Refused with speculative decoding's
            varlen_verify=True (its verify lengths follow the batch).
        zero_overhead_scheduling: ZOS (docs/design.md §6): the host schedules and launches decode step N + 1
            before it reads step N's sampled tokens, which feed step N + 1 on the device, so host work
            overlaps the GPU; a request's end is then seen one step late (its extra token is dropped).
            None = on for NORMAL and COMPLETION engines (speculative decode steps included, except on
            CUDA, where they need True), off for PROMPT engines.
        data_parallel_size: attention data-parallel ranks, one process each (docs/design.md §9): `LLM` spawns
            them (or, under torchrun, this process is rank RANK of WORLD_SIZE); each runs its own engine,
            requests go to the least-loaded rank and every rank runs the same kind of step. 1 = one
            process. `deepinfer serve` runs N engine processes behind one server; `deepinfer generate`
            and `deepinfer bench` drive one engine and refuse N > 1.
        expert_parallel: shard the routed experts over the data-parallel ranks (EP size = DP size), tokens
            dispatched and combined by all-to-all; needs data_parallel_size >= 2. Decode steps exchange
            fixed-capacity buffers (max_num_seqs × top-k rows per peer, no host read), so ZOS stays on;
            prefill steps send variable splits. Tested on CPU (gloo) only: on CUDA an EP rank decodes
            eagerly (NCCL all-to-alls inside the decode CUDA graphs have not run on GPUs yet).
        eplb: re-place experts live from the routed-token counts (needs expert_parallel): "prefill" (4
            redundant experts per rank, 100-step window, every 1,000 steps) or "decode" (1 per rank,
            1,000, every 10,000), docs/design.md §10; None = the initial round-robin placement, no redundancy.
        eplb_redundant_experts_per_rank: floor of redundant experts per rank, rounded up so that the
            slot count divides over the ranks; None = the eplb preset's.
        eplb_window_steps: steps whose expert counts a placement is computed from; None = the preset's.
        eplb_interval_steps: steps between placements; None = the preset's.
        distributed_timeout_s: with data_parallel_size >= 2, how long a rank waits for its peers in a
            collective (and `LLM` for a rank) before failing with an error naming the rank.
        num_speculative_tokens: speculative decoding with the checkpoint's DSpark draft head (its
            `mtp.*` tensors; refused, naming them, for a checkpoint without them), k drafts per request
            and step (the released checkpoints' dspark_block_size is 5); 0 = off. Each decode step
            verifies the drafts in one forward and keeps the accepted ones plus one target token
            (docs/spec.md); greedy output is the same as without it.
            Its verify forwards replay CUDA graphs keyed by total query tokens, its draft walks CUDA
            graphs keyed the same way by drafting rows. ZOS covers speculative steps by default, on
            the CPU and on CUDA (greedy tokens equal with it on and off under graphs, checked on an H100).
            With data_parallel_size > 1 each rank drafts and verifies its own requests; under
            expert_parallel the ranks agree on each step's verify size (a rank without decode rows
            runs a dummy verify forward of it).
        varlen_verify: with num_speculative_tokens > 0, how many of the k drafts each request verifies:
            True = the choice by expected throughput (docs/design.md §7), from the verify forward's,
            the draft walk's and the verification's times measured at start-up (kept in
            DEEPINFER_VARLEN_PROFILE_CACHE for the next start of the same config) and the draft head's
            confidences: a row whose drafts do not pay for their share of the forward and the draft
            walk verifies none (a plain decode row), and where drafting cannot pay at any batch size
            the engine says so at start and decodes plainly (a request's tokens then depend on its
            batch, even seeded ones); False = all k.
        enable_prefix_caching: reuse the KV blocks and the model state of cached prompt prefixes
            (docs/prefix_cache.md): a prompt starting with the tokens of an earlier prompt (a chat's
            previous turn, a shared system prompt) prefills only the rest, from its last full block
            that has a state snapshot; outputs are the same as without it. A prompt's prefill is cut at
            its last block boundary (and where it leaves a shared cached prefix) to save a snapshot
            there. Ignored by COMPLETION engines.
        prefix_cache_snapshots: state snapshots the prefix cache keeps (each the ring rows a block
            boundary leaves live, a third of a state slot on V4-Flash, paid for out of the cache
            budget; the least recently used is replaced); None = 2 ×
            max_num_seqs (a chat between turns holds one, a shared system prompt one more), but at most
            what a quarter of the cache budget left by the state slots holds when the budget sizes the
            cache (none: prefix caching is off, with a warning).
        prefix_cache_host_mb: MiB of host memory (pinned on CUDA) for the prefix cache's host tier:
            cached KV blocks and state snapshots the device evicts are copied there and come back
            on a hit instead of being prefilled again (the least recently used is replaced); split
            between blocks and snapshots as the device cache splits its bytes. None = 4096 on CUDA
            (at most a quarter of the machine's memory), 0 on CPU (the cache is in host memory
            already); 0 = no host tier.
    """

    model: str | None = None
    load_format: str = "safetensors"
    device: str = AUTO
    dtype: str = AUTO
    seed: int = 0
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_mb: float | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_prompts: int | None = None
    prefill_max_sum_seqlen_k: int | None = None
    chunk_checkpoints: tuple[int, ...] = ()
    stop_preempted_request: bool = True
    max_cache_usage_for_prefill: float = 0.9
    engine_type: EngineType = EngineType.NORMAL
    kv_quant: bool = False
    expert_dtype: str | None = None
    enforce_eager: bool = False
    engram_on_host: bool = False
    yoco_prefill_truncation_mode: str = "off"
    yoco_prefill_keep_tokens: int = 140
    batch_invariant: bool = False
    zero_overhead_scheduling: bool | None = None
    data_parallel_size: int = 1
    expert_parallel: bool = False
    eplb: str | None = None
    eplb_redundant_experts_per_rank: int | None = None
    eplb_window_steps: int | None = None
    eplb_interval_steps: int | None = None
    distributed_timeout_s: float = 120.0
    num_speculative_tokens: int = 0
    varlen_verify: bool = True
    enable_prefix_caching: bool = True
    prefix_cache_snapshots: int | None = None
    prefix_cache_host_mb: float | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            _fail("model", f"model={self.model!r} must be a folder path (str) or None")
        if not isinstance(self.load_format, str) or self.load_format not in LOAD_FORMATS:
            _fail("load_format", f"load_format={self.load_format!r} must be one of "
                  f"{', '.join(map(repr, LOAD_FORMATS))}")
        self._check_device()
        for name, (low, high) in INT_RANGES.items():
            value = getattr(self, name)
            if value is not None or name not in OPTIONAL_FIELDS:
                _int(name, value, low, high)
        self._check_memory()
        _check_checkpoints(self.chunk_checkpoints)
        self._check_choices()
        self._check_parallel()
        self._check_speculative()

    def _check_device(self) -> None:
        """device and dtype."""
        if not isinstance(self.device, str):
            _fail("device", f"device={self.device!r} must be 'auto', 'cpu' or 'cuda[:N]' (a str)")
        if self.device != AUTO:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError):
                _fail("device", f"device={self.device!r} must be 'auto', 'cpu' or 'cuda[:N]'")
            if device.type not in ("cpu", "cuda"):
                _fail("device", f"device={self.device!r} must be 'auto', 'cpu' or 'cuda[:N]'")
        if not isinstance(self.dtype, str) or (self.dtype not in DTYPES and self.dtype != AUTO):
            _fail("dtype", f"dtype={self.dtype!r} must be 'auto' or one of {sorted(DTYPES)}")

    def _check_memory(self) -> None:
        mb = self.kv_cache_memory_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int | float)
                               or not 0 < mb <= MAX_KV_CACHE_MEMORY_MB):
            _fail("kv_cache_memory_mb", f"kv_cache_memory_mb={mb!r} must be > 0 and <= {MAX_KV_CACHE_MEMORY_MB} "
                  "(MiB, 16 TiB)")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util < 1):
            _fail("gpu_memory_utilization", f"gpu_memory_utilization={util!r} must be in (0, 1)")
        host = self.prefix_cache_host_mb
        if host is not None and (isinstance(host, bool) or not isinstance(host, int | float)
                                 or not 0 <= host <= MAX_KV_CACHE_MEMORY_MB):
            _fail("prefix_cache_host_mb", f"prefix_cache_host_mb={host!r} must be >= 0 and <= "
                  f"{MAX_KV_CACHE_MEMORY_MB} (MiB, 16 TiB)")
        usage = self.max_cache_usage_for_prefill
        if isinstance(usage, bool) or not isinstance(usage, int | float) or not 0 <= usage <= 1:
            _fail("max_cache_usage_for_prefill", f"max_cache_usage_for_prefill={usage!r} must be in [0, 1]")

    def _check_choices(self) -> None:
        """The fields that take one of a few values: modes, dtypes, flags, the engine type."""
        if self.yoco_prefill_truncation_mode not in TRUNCATION_MODES:
            _fail("yoco_prefill_truncation_mode", f"yoco_prefill_truncation_mode={self.yoco_prefill_truncation_mode!r} "
                  f"must be one of {', '.join(map(repr, TRUNCATION_MODES))}")
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            _fail("expert_dtype", f"expert_dtype={self.expert_dtype!r} must be None, 'fp8' or 'fp4'")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"{name}={getattr(self, name)!r} must be a bool")
        if self.zero_overhead_scheduling is not None and not isinstance(self.zero_overhead_scheduling, bool):
            _fail("zero_overhead_scheduling", f"zero_overhead_scheduling={self.zero_overhead_scheduling!r} must be "
                  "a bool or None")
        if not isinstance(self.engine_type, EngineType):
            _fail("engine_type", f"engine_type={self.engine_type!r} must be an EngineType (NORMAL, PROMPT or "
                  "COMPLETION)")
        if self.prefix_cache_snapshots is not None and not self.enable_prefix_caching:
            _fail("prefix_cache_snapshots", f"prefix_cache_snapshots={self.prefix_cache_snapshots} needs "
                  "enable_prefix_caching=True")
        if self.prefix_cache_host_mb and not self.enable_prefix_caching:
            _fail("prefix_cache_host_mb", f"prefix_cache_host_mb={self.prefix_cache_host_mb} needs "
                  "enable_prefix_caching=True")

    def _check_parallel(self) -> None:
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or \
                not 0 < timeout <= MAX_DISTRIBUTED_TIMEOUT_S:
            _fail("distributed_timeout_s", f"distributed_timeout_s={timeout!r} must be > 0 and <= "
                  f"{MAX_DISTRIBUTED_TIMEOUT_S} (seconds)")
        if self.expert_parallel and self.data_parallel_size < 2:
            _fail("expert_parallel", f"expert_parallel=True needs data_parallel_size >= 2 (EP size = DP size), "
                  f"got data_parallel_size={self.data_parallel_size}")
        if self.eplb is not None and self.eplb not in EPLB_PRESETS:
            _fail("eplb", f"eplb={self.eplb!r} must be None or one of {', '.join(map(repr, EPLB_PRESETS))}")
        if self.eplb is not None and not self.expert_parallel:
            _fail("eplb", f"eplb={self.eplb!r} needs expert_parallel=True")
        for name in ("eplb_redundant_experts_per_rank", "eplb_window_steps", "eplb_interval_steps"):
            if getattr(self, name) is not None and self.eplb is None:
                _fail(name, f"{name}={getattr(self, name)!r} needs eplb ('prefill' or 'decode')")

    def _check_speculative(self) -> None:
        if not self.num_speculative_tokens:
            return
        k = self.num_speculative_tokens
        if self.engine_type is EngineType.PROMPT:
            _fail("num_speculative_tokens", f"num_speculative_tokens={k} needs a NORMAL or COMPLETION engine (a "
                  "PROMPT engine never decodes)")
        if self.batch_invariant and self.varlen_verify:
            _fail("varlen_verify", f"varlen_verify=True with num_speculative_tokens={k} picks each request's verify "
                  "length from its batch, which batch_invariant=True promises it does not depend on: pass "
                  "varlen_verify=False (--no-varlen-verify: every draft verified) or batch_invariant=False")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as torch's; needs a resolved dtype (not "auto")."""
        if self.dtype == AUTO:
            raise ValueError("dtype='auto' has no torch dtype until resolved(): use EngineArgs.resolved()")
        return DTYPES[self.dtype]

    def resolved(self) -> EngineArgs:
        """A copy whose defaults are made concrete for this machine and model (idempotent):

        - model: a Hugging Face repo id -> its snapshot folder in the local cache;
        - device "auto" -> "cuda" if torch.cuda.is_available() else "cpu";
        - dtype "auto" -> "float32" on CPU; on CUDA "float16" if config.json asks for it, else "bfloat16";
        - gpu_memory_utilization None -> 0.9 on CUDA when num_kv_blocks and kv_cache_memory_mb are None;
        - kv_cache_memory_mb None -> 256;
        - prefix_cache_host_mb None -> 4096 on CUDA with prefix caching on (at most a quarter of the
          machine's memory), else 0.

        Raises:
            InvalidEngineArgs: a repo id that is not in the local Hugging Face cache (field "model").
        """
        from .model_source import ModelNotCached, config_dtype, resolve_model_source

        model = self.model
        if model is not None:
            try:
                model = resolve_model_source(model)
            except ModelNotCached as error:
                _fail("model", str(error))
        device = self.device
        if device == AUTO:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cuda = torch.device(device).type == "cuda"
        dtype = self.dtype
        if dtype == AUTO:
            dtype = "float32" if not on_cuda else \
                "float16" if config_dtype(model or _embedded_model_dir()) == "float16" else "bfloat16"
        util = self.gpu_memory_utilization
        if util is None and on_cuda and self.num_kv_blocks is None and self.kv_cache_memory_mb is None:
            util = DEFAULT_GPU_MEMORY_UTILIZATION
        mb = DEFAULT_KV_CACHE_MEMORY_MB if self.kv_cache_memory_mb is None else self.kv_cache_memory_mb
        host_mb = self.prefix_cache_host_mb
        if host_mb is None:
            host_mb = min(DEFAULT_PREFIX_CACHE_HOST_MB, _host_memory_mb() / 4) \
                if on_cuda and self.enable_prefix_caching else 0.0
        return dataclasses.replace(self, model=model, device=device, dtype=dtype, gpu_memory_utilization=util,
                                   kv_cache_memory_mb=mb, prefix_cache_host_mb=host_mb)

    @property
    def zos(self) -> bool:
        """Whether ZOS is on: zero_overhead_scheduling, or by default on unless a PROMPT engine."""
        if self.zero_overhead_scheduling is not None:
            return self.zero_overhead_scheduling
        return self.engine_type is not EngineType.PROMPT


def allowed_values(name: str) -> str:
    """The values an `EngineArgs` field accepts, in words (the docs' "allowed" column).

    Raises:
        KeyError: `name` is not a field of EngineArgs.
    """
    none = ", or None" if name in OPTIONAL_FIELDS else ""
    if name in INT_RANGES:
        low, high = INT_RANGES[name]
        return f"int in [{low}, {high}]{none}"
    return {
        "model": "a folder path, a cached Hugging Face repo id, or None",
        "load_format": ", ".join(LOAD_FORMATS),
        "device": "auto, cpu, cuda or cuda:N",
        "dtype": ", ".join((AUTO, *DTYPES)),
        "kv_cache_memory_mb": f"float in (0, {MAX_KV_CACHE_MEMORY_MB}], or None",
        "gpu_memory_utilization": "float in (0, 1), or None",
        "chunk_checkpoints": f"ints in [1, {MAX_INT32}], strictly increasing",
        "stop_preempted_request": "bool",
        "max_cache_usage_for_prefill": "float in [0, 1]",
        "engine_type": ", ".join(member.name for member in EngineType),
        "kv_quant": "bool",
        "expert_dtype": ", ".join(EXPERT_DTYPES) + ", or None",
        "enforce_eager": "bool",
        "engram_on_host": "bool",
        "yoco_prefill_truncation_mode": ", ".join(TRUNCATION_MODES),
        "batch_invariant": "bool",
        "zero_overhead_scheduling": "bool, or None",
        "expert_parallel": "bool",
        "eplb": ", ".join(EPLB_PRESETS) + ", or None",
        "distributed_timeout_s": f"float in (0, {MAX_DISTRIBUTED_TIMEOUT_S}]",
        "varlen_verify": "bool",
        "enable_prefix_caching": "bool",
        "prefix_cache_host_mb": f"float in [0, {MAX_KV_CACHE_MEMORY_MB}], or None",
    }[name]


def _host_memory_mb() -> float:
    """The machine's physical memory in MiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


def _embedded_model_dir() -> str:
    from deepinfer.model import embedded_model_dir
    return str(embedded_model_dir())


def _check_checkpoints(checkpoints: object) -> None:
    if not isinstance(checkpoints, tuple):
        _fail("chunk_checkpoints", f"chunk_checkpoints={checkpoints!r} must be a tuple of token positions")
    previous = 0
    for index, position in enumerate(checkpoints):
        if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position <= MAX_INT32:
            _fail("chunk_checkpoints", f"chunk_checkpoints[{index}]={position!r} must be an integer in "
                  f"[1, {MAX_INT32}]")
        if position <= previous:
            _fail("chunk_checkpoints", f"chunk_checkpoints[{index}]={position} must be > chunk_checkpoints"
                  f"[{index - 1}]={previous}: positions are strictly increasing")
        previous = position


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidEngineArgs(message, field)


def _int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(name, f"{name}={value!r} must be an integer in [{low}, {high}]")
