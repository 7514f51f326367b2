# Types of the Cython BlockManager (_block_pool.pyx): the same interface as its pure-Python twin,
# which the tests run against the same cases.
from ._pure.block_pool import BlockManager as BlockManager
