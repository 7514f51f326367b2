# Declarations of the Cython block pool (implementation in _block_pool.pyx).
from ._free_list cimport FreeList


cdef class BlockManager:
    cdef FreeList _list

    cdef object _checked(self, object block_ids)
