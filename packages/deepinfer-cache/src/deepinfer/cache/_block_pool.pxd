# Declarations of the Cython block pool (implementation in _block_pool.pyx).
from ._free_list cimport FreeList


cdef class BlockManager:
    cdef FreeList _list
    cdef list _hashes       # [num_blocks] the content hash (bytes) of each cached block, else None
    cdef dict _by_hash      # content hash -> block id, for every cached block
    cdef list _evicted      # (block id, hash) of cached blocks `allocate` handed out; None = not recorded

    cdef object _checked(self, object block_ids)
    cdef object _evict(self, object block_ids)
