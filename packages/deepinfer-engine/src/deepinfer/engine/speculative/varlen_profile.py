"""The varlen verify policy's step-time curve at engine start: loaded from the profile cache, else
measured and stored there (docs/design.md §7.2, docs/spec.md "Varlen verify").

The cache is one JSON file (`deepinfer.spec.ProfileCache`, DEEPINFER_VARLEN_PROFILE_CACHE) with an
entry per `profile_key` of `profile_fields`: everything the measured times depend on. A cache that
cannot be read or written costs a measurement and a warning, never the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer.model import DSparkDraft
from deepinfer.spec import ProfileCache, StepTimeCurve, cuda_graph_sizes, profile_key, profile_step_times

from ..config.engine_args import EngineArgs
from ..config.env import EngineEnv, env_var_name, varlen_profile_cache_path
from ..core.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# What the measurement is (SpeculativeDecoder._time_dummy_step, 5 trimmed replays): bump it when that
# changes, so that curves measured the old way are never loaded.
PROFILE_FORMAT = 1


def varlen_step_time_curve(run_step: Callable[[int], float], draft: DSparkDraft, runner: ModelRunner,
                           args: EngineArgs, env: EngineEnv) -> StepTimeCurve:
    """The step-time curve up to max_num_seqs × (k + 1) tokens: the cached one for this model and
    parallel config, else `profile_step_times(run_step, sizes)`, then cached. Sizes: every verify graph
    size where the runner captured graphs (a step pads up to one); without graphs (CPU, enforce_eager)
    the eager forward's time grows smoothly, so powers of two and the largest size, between which
    `StepTimeCurve.at` interpolates (a tenth of the measurements at max_num_seqs = 64)."""
    sizes = profile_sizes(args.max_num_seqs * (draft.block_size + 1), runner.graphs is not None,
                          env.cudagraph_batch_size_interval)
    key = profile_key(*profile_fields(draft, runner, args, env, sizes))
    return load_or_measure(run_step, sizes, key, varlen_profile_cache_path(env))


def profile_sizes(max_total_q: int, graphs: bool, interval: int) -> tuple[int, ...]:
    """The verify sizes measured: `cuda_graph_sizes(max_total_q, interval)` with graphs, else the powers
    of two below max_total_q and max_total_q itself."""
    if graphs:
        return cuda_graph_sizes(max_total_q, interval)
    return tuple(sorted({*(1 << i for i in range(max_total_q.bit_length())), max_total_q}))


def profile_fields(draft: DSparkDraft, runner: ModelRunner, args: EngineArgs, env: EngineEnv,
                   sizes: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, parallel) fields of `profile_key`: the model's config (config.json as parsed), its
    dtypes, kv_quant and draft head; the device, kernels, torch, the graphs and the sizes measured,
    the data-parallel / expert-parallel sizes."""
    graphs = runner.graphs
    model = {
        "format": PROFILE_FORMAT,
        "config": dataclasses.asdict(runner.model.cfg),
        "dtype": args.dtype,
        "expert_dtype": args.expert_dtype,
        "kv_quant": args.kv_quant,
        "k": draft.block_size,
        "draft_stages": draft.num_stages,
    }
    device = runner.device
    parallel = {
        "device": _device_name(device),
        "kernels": dict(runner.ops.sources),
        "batch_invariant": args.batch_invariant,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "sizes": sorted(set(sizes)),
        "max_num_seqs": args.max_num_seqs,
        "cudagraph_interval": env.cudagraph_batch_size_interval,
        "enforce_eager": args.enforce_eager,
        "graphs": None if graphs is None else {"sizes": list(graphs.sizes), "max_blocks": graphs.block_tables.shape[1],
                                               "max_context_len": graphs.max_context_len,
                                               "max_query_len": graphs.max_query_len},
        "block_size": runner.plan.block_size,
        "data_parallel_size": args.data_parallel_size,
        "expert_parallel_size": args.data_parallel_size if args.expert_parallel else 1,
        "world_size": torch.distributed.get_world_size() if _distributed() else 1,
    }
    return model, parallel


def load_or_measure(run_step: Callable[[int], float], sizes: Sequence[int], key: str,
                    cache_path: str | None) -> StepTimeCurve:
    """The curve cached under `key` in `cache_path` (None: no cache), else measured and stored there.
    Logs (logger deepinfer.engine.speculative.varlen_profile) one info line saying which, and a warning for a
    cache file that could not be read (then measured) or written."""
    cache = None if cache_path is None else ProfileCache(cache_path)
    if cache is not None:
        try:
            curve = cache.load(key)
        except (OSError, ValueError) as err:
            logger.warning("varlen profile cache %s is unreadable (%s); measuring the step-time curve again",
                           cache.path, err)
            curve = None
        if curve is not None:
            logger.info("varlen step-time curve (%d sizes): loaded from %s (key %s)", len(curve.sizes),
                        cache.path, key[:16])
            return curve
    started = time.perf_counter()
    curve = profile_step_times(run_step, sizes)
    seconds = time.perf_counter() - started
    if cache is None:
        where = f"not cached ({env_var_name('varlen_profile_cache')}=off)"
    else:
        try:
            cache.store(key, curve)
            where = f"stored in {cache.path} (key {key[:16]})"
        except OSError as err:
            logger.warning("could not write the varlen profile cache %s (%s); the next start measures again",
                           cache.path, err)
            where = "not stored"
    logger.info("varlen step-time curve (%d sizes): measured in %.2f s, %s", len(curve.sizes), seconds, where)
    return curve


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # CPU times depend on the processor and on how many threads torch runs
    return f"{device.type}: {_cpu_model()}, {torch.get_num_threads()} threads"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
