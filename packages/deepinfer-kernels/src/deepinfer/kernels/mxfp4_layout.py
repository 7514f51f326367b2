"""The re-packed MXFP4 code layout of the `packed` decoder (`triton_ops.mxfp4_packed`), and its inverse.

The checkpoint layout (`reference.dequant_mxfp4`): per weight row, bytes of two e2m1 codes, low nibble
first, natural column order; one e8m0 scale byte per 32 columns. `repack_mxfp4_for_decode` permutes the
bits inside each 16-byte group (the 32 codes of one scale group) once, at load time; the scales stay as
they are. Each 16-byte group becomes four little-endian 32-bit words c = 0…3, and word c holds the four
column pairs that an MMA A-fragment gives lane c of a row: pairs c, c + 4, c + 8, c + 12 (columns 2p,
2p + 1 of pair p) — the columns 2c, 2c + 8, 16 + 2c, 24 + 2c of Hopper's m64nNk16 fragment. So the
decoded registers come out in natural column order and the activations load contiguously.

Inside word c, the codes of pair c + 4j sit where four rotations and masks put them as the bfloat16 bits
of code × 2^-126 (`_raw_pair`'s form: magnitude bits on bits 6–8, sign on bit 15; the pair's second code
on bits 22–24 and 31):

    R0 = W & M                     M = 0x81C081C0
    R1 = rotl(W, 4) & M
    R2 = rotl(W, 10) & M
    R3 = (rotl(W, 6) & 0x80C080C0) | (rotl(W, 14) & 0x01000100)

R_j is pair j: nine integer instructions per 8 codes. `SOURCE_BITS[j][h][b]` is the word bit holding bit
b (0–2 magnitude, 3 sign) of pair j's code h (0: the even column); every word bit is used once.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_TARGET = ((6, 7, 8, 15), (22, 23, 24, 31))            # bf16 bits of code h's magnitude bits 0-2 and sign
_ROTATIONS = (0, 4, 10)                                # R0-R2: one rotation each
_R3_ROTATION = {6: 6, 7: 6, 15: 6, 22: 6, 23: 6, 31: 6, 8: 14, 24: 14}   # R3: target bit -> rotation

SOURCE_BITS: tuple[tuple[tuple[int, ...], ...], ...] = tuple(
    tuple(tuple((t - (_ROTATIONS[j] if j < 3 else _R3_ROTATION[t])) % 32 for t in half) for half in _TARGET)
    for j in range(4))


def _check_codes(codes: Tensor) -> Tensor:
    if codes.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"codes.dtype={codes.dtype} must be uint8 or int8 (two e2m1 codes per byte)")
    if codes.dim() < 1 or codes.shape[-1] % 16:
        raise ValueError(f"codes.shape={tuple(codes.shape)}: the last dim (bytes per row) must be a multiple of "
                         "16 (32 columns per MXFP4 group)")
    return codes.view(torch.uint8)


@functools.cache
def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(scatter [4, 256] int64: byte j's value → its bits at their word positions; gather [4, 256] int64:
    word byte q's value → the bits it gives to bytes 0–3 of the four pairs, as one 32-bit value)."""
    values = torch.arange(256, dtype=torch.int64)
    scatter = torch.zeros(4, 256, dtype=torch.int64)
    gather = torch.zeros(4, 256, dtype=torch.int64)
    for j in range(4):
        for h in range(2):
            for b in range(4):
                src = SOURCE_BITS[j][h][b]
                scatter[j] |= ((values >> (4 * h + b)) & 1) << src
                gather[src // 8] |= ((values >> (src % 8)) & 1) << (8 * j + 4 * h + b)
    return scatter.to(device), gather.to(device)


def repack_mxfp4_for_decode(codes: Tensor) -> Tensor:
    """Checkpoint-layout MXFP4 codes → the `packed` decoder's layout (the module docstring).

    Args:
        codes: [..., K / 2] uint8 (or int8), two e2m1 codes per byte, low nibble first, natural column
            order; K / 2 a multiple of 16. Any leading dims (experts, rows).
    Returns:
        [..., K / 2] uint8, same shape and device, bits permuted inside each 16-byte group (a new tensor).
    Raises:
        ValueError: another dtype, or a last dim that is not a multiple of 16.
    """
    codes = _check_codes(codes)
    scatter, _ = _tables(codes.device)
    pairs = codes.reshape(*codes.shape[:-1], -1, 4, 4).long()           # [..., groups, j, c]: pair 4j + c
    words = scatter[0][pairs[..., 0, :]] | scatter[1][pairs[..., 1, :]] | scatter[2][pairs[..., 2, :]] \
        | scatter[3][pairs[..., 3, :]]                                     # [..., groups, c]
    out = torch.stack([(words >> (8 * q)) & 0xFF for q in range(4)], -1)    # little-endian bytes of word c
    return out.to(torch.uint8).reshape(codes.shape)


def unpack_mxfp4_from_decode(packed: Tensor) -> Tensor:
    """The inverse of `repack_mxfp4_for_decode`: the `packed` layout → checkpoint-layout codes.

    Args:
        packed: [..., K / 2] uint8 (or int8) in the `packed` layout; K / 2 a multiple of 16.
    Returns:
        [..., K / 2] uint8 codes, two per byte, low nibble first, natural column order (a new tensor).
    Raises:
        ValueError: as `repack_mxfp4_for_decode`.
    """
    packed = _check_codes(packed)
    _, gather = _tables(packed.device)
    words = packed.reshape(*packed.shape[:-1], -1, 4, 4).long()          # [..., groups, c, word byte q]
    pairs = gather[0][words[..., 0]] | gather[1][words[..., 1]] | gather[2][words[..., 2]] \
        | gather[3][words[..., 3]]                                         # [..., groups, c]: bytes of pairs j
    out = torch.stack([(pairs >> (8 * j)) & 0xFF for j in range(4)], -2)   # [..., groups, j, c]
    return out.to(torch.uint8).reshape(packed.shape)
