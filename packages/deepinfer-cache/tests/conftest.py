"""Every BlockManager test runs on both the Cython pool and its pure-Python twin."""

from __future__ import annotations

import pytest

from deepinfer.cache._block_pool import BlockManager as CythonBlockManager
from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager

IMPLEMENTATIONS = {"cython": CythonBlockManager, "pure": PureBlockManager}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def manager_cls(request: pytest.FixtureRequest) -> type:
    return IMPLEMENTATIONS[request.param]
