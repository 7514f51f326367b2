# Types of the Cython decode core (_decode_core.pyx): the same functions as its numpy twin.
from ._pure.decode_core import commit_decode as commit_decode
from ._pure.decode_core import count_new_blocks as count_new_blocks
from ._pure.decode_core import gather_block_tables as gather_block_tables
