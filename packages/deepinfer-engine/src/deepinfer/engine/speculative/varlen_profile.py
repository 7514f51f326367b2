"""The varlen verify policy's start-up curves, loaded from the profile cache, else measured and
stored there (docs/design.md §7.2, docs/spec.md "Varlen verify"), and the policy built on them.

Three curves: the verify forward's ms per graph size (every size the engine can replay), the draft
walk's ms per number of drafting rows and the verification's ms per number of rows (the sampler
estimate before real steps feed it). The cache is one JSON file (`deepinfer.spec.ProfileCache`,
DEEPINFER_VARLEN_PROFILE_CACHE) with an entry per curve and `profile_key` of `profile_fields`:
everything the measured times depend on. A cache that cannot be read or written costs a measurement
and a warning, never the engine. Lockstep ranks (`spec_lockstep`) load only when every rank found
the curves, and keep the mean over the EP group of what they measure.

Where drafting cannot pay at any batch size even with every draft accepted (`drafting_can_pay`; a CPU
whose forward time grows with every query token, say), one info line says so and the policy decodes
plainly: every row gets q = 1.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.model import DSparkDraft
from deepinfer.spec import (
    DraftRuntimeEstimator,
    ForwardRuntimeEstimator,
    ProfileCache,
    SamplerRuntimeEstimator,
    StepTimeCurve,
    VarlenVerifyPolicy,
    cuda_graph_sizes,
    drafting_can_pay,
    profile_key,
    profile_step_times,
)

from ..config.engine_args import EngineArgs
from ..config.env import EngineEnv, env_var_name, varlen_profile_cache_path
from ..core.model_runner import ModelRunner
from .spec_dummy import DummySpecSteps
from .spec_lockstep import SpecLockstep

logger = logging.getLogger(__name__)

# What the measurement is (DummySpecSteps, 5 trimmed replays): bump it when that changes, so that
# curves measured the old way are never loaded. 2: the draft walk and verification curves.
PROFILE_FORMAT = 2
CURVES = ("verify", "draft", "sampler")


@dataclass(frozen=True, slots=True)
class StartupProfile:
    """The varlen policy's start-up curves.

    Attributes:
        verify: verify forward ms per graph size (total query tokens).
        draft: draft walk ms per number of drafting rows.
        sampler: verification (and the results' copy to the host) ms per number of rows.
    """

    verify: StepTimeCurve
    draft: StepTimeCurve
    sampler: StepTimeCurve


def varlen_policy(dummy: DummySpecSteps, runner: ModelRunner, args: EngineArgs, env: EngineEnv,
                  lockstep: SpecLockstep | None = None) -> VarlenVerifyPolicy:
    """The varlen policy over the start-up curves (`startup_profile`); `plain_only` (with one info line)
    when drafting cannot pay at any batch size even with every draft accepted."""
    profile = startup_profile(dummy, runner, args, env, lockstep)
    forward = ForwardRuntimeEstimator(profile.verify, interval=env.cudagraph_batch_size_interval)
    sampler, draft = SamplerRuntimeEstimator(prior=profile.sampler), DraftRuntimeEstimator(prior=profile.draft)
    k = dummy.k
    pays = drafting_can_pay(args.max_num_seqs, k + 1, forward, sampler, draft)
    if not pays:
        logger.info("speculative decoding cannot pay on %s: even with every draft accepted, verifying k=%d drafts "
                    "(verify forward %.3g ms at %d tokens vs %.3g ms at 1, draft walk %.3g ms) yields fewer tokens "
                    "per ms than plain decoding at every batch size up to max_num_seqs=%d; decoding plainly "
                    "(every row verifies 0 drafts)", _device_name(runner.device), k, forward.estimate_ms(k + 1), k + 1,
                    forward.estimate_ms(1), draft.estimate_ms(1), args.max_num_seqs)
    return VarlenVerifyPolicy(forward, sampler, draft=draft, plain_only=not pays)


def startup_profile(dummy: DummySpecSteps, runner: ModelRunner, args: EngineArgs, env: EngineEnv,
                    lockstep: SpecLockstep | None = None) -> StartupProfile:
    """The three curves: the cached ones for this model and parallel config, else measured
    (`profile_step_times` over `DummySpecSteps`), then cached. Verify sizes: every graph size the
    runner captured, and without graphs (CPU, enforce_eager), where the eager forward's time grows
    smoothly, powers of two and the largest size, between which `StepTimeCurve.at` interpolates; up to
    max_num_seqs × (k + 1) tokens either way. Row counts: powers of two and max_num_seqs."""
    graphs = runner.graphs
    sizes = profile_sizes(args.max_num_seqs * (dummy.k + 1), graphs is not None, env.cudagraph_batch_size_interval)
    if graphs is not None:
        sizes = tuple(sorted({*graphs.sizes, *sizes}))
    rows = profile_sizes(args.max_num_seqs, False, env.cudagraph_batch_size_interval)
    model, parallel = profile_fields(dummy.draft, runner, args, env, sizes)
    keys = {name: profile_key(model, parallel if name == "verify" else {**parallel, "curve": name, "rows": rows})
            for name in CURVES}
    steps: dict[str, tuple[Callable[[int], float], Sequence[int]]] = {
        "verify": (dummy.timed(dummy.verify_forward), sizes),
        "draft": (dummy.timed(dummy.draft_walk), rows),
        "sampler": (dummy.timed(dummy.verification), rows),
    }
    curves = load_or_measure(steps, keys, varlen_profile_cache_path(env), lockstep)
    return StartupProfile(**curves)


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


def load_or_measure(steps: dict[str, tuple[Callable[[int], float], Sequence[int]]], keys: dict[str, str],
                    cache_path: str | None, lockstep: SpecLockstep | None = None) -> dict[str, StepTimeCurve]:
    """The curves cached under `keys` (by name) in `cache_path` (None: no cache), else each measured
    over its sizes with its step (`steps`, by name) and stored there; lockstep ranks load only when
    every rank found every curve, and keep the mean over the EP group of what they measure. Logs
    (logger deepinfer.engine.speculative.varlen_profile) one info line saying which, and a warning for a cache
    file that could not be read (then measured) or written."""
    cache = None if cache_path is None else ProfileCache(cache_path)
    loaded: dict[str, StepTimeCurve] = {}
    if cache is not None:
        try:
            loaded = {name: curve for name, key in keys.items() if (curve := cache.load(key)) is not None}
        except (OSError, ValueError) as err:
            logger.warning("varlen profile cache %s is unreadable (%s); measuring the step-time curves again",
                           cache.path, err)
            loaded = {}
    found = len(loaded) == len(keys)
    if lockstep is not None:
        found = lockstep.all_true(found)
    verify_key = keys["verify"][:16]
    if found and cache is not None:
        logger.info("varlen step-time curves (%d verify sizes): loaded from %s (key %s)", len(loaded["verify"].sizes),
                    cache.path, verify_key)
        return loaded
    started = time.perf_counter()
    curves = {name: profile_step_times(run_step, sizes) for name, (run_step, sizes) in steps.items()}
    if lockstep is not None:
        curves = {name: lockstep.mean_curve(curve) for name, curve in curves.items()}
    seconds = time.perf_counter() - started
    if cache is None:
        where = f"not cached ({env_var_name('varlen_profile_cache')}=off)"
    else:
        try:
            for name, curve in curves.items():
                cache.store(keys[name], curve)
            where = f"stored in {cache.path} (key {verify_key})"
        except OSError as err:
            logger.warning("could not write the varlen profile cache %s (%s); the next start measures again",
                           cache.path, err)
            where = "not stored"
    logger.info("varlen step-time curves (%d verify sizes): measured in %.2f s, %s", len(curves["verify"].sizes),
                seconds, where)
    return curves


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
