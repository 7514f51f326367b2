"""Fixtures: schedulers over the Cython decode core and over its numpy twin."""

from __future__ import annotations

import importlib.util

import pytest

from deepinfer.cache import BlockManager
from deepinfer.sched import Scheduler, SchedulerConfig

NATIVE_BUILT = importlib.util.find_spec("deepinfer.sched._decode_core") is not None

_DEFAULTS = dict(block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(
    params=[
        pytest.param(True, id="cython",
                     marks=pytest.mark.skipif(not NATIVE_BUILT, reason="Cython decode core not built")),
        pytest.param(False, id="numpy"),
    ]
)
def native(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def make_sched(native: bool):
    """make_sched(num_blocks=64, num_slots=None, vote_group=None, verify_policy=None, num_snapshots=4,
    host=None, **config): a Scheduler over fresh BlockManagers (num_slots usable state slots; None =
    max_num_seqs; num_snapshots snapshot slots when config turns prefix caching on; host = (host
    blocks, host snapshots) of a host tier)."""

    def make(num_blocks: int = 64, num_slots: int | None = None, vote_group=None, verify_policy=None,
             num_snapshots: int = 4, host: tuple[int, int] | None = None, **config: object) -> Scheduler:
        cfg = SchedulerConfig(**{**_DEFAULTS, **config})
        slots = BlockManager((cfg.max_num_seqs if num_slots is None else num_slots) + 1)
        host_blocks, host_snapshots = (None, None) if host is None else (BlockManager(n + 1) for n in host)
        return Scheduler(cfg, BlockManager(num_blocks), slots, vote_group=vote_group,
                         verify_policy=verify_policy, native=native, snapshot_slots=BlockManager(num_snapshots + 1),
                         host_blocks=host_blocks, host_snapshots=host_snapshots)

    return make
