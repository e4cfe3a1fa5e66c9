"""Tile helpers shared by the row-tiled DCP kernels (``[rows, head-dim chunk]`` tiles)."""

import triton
import triton.language as tl


@triton.jit
def _chunk_mask(m_r, i_d, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[BLOCK_R, BLOCK_D]`` mask of the head-dim lanes ``i_d`` of the rows ``m_r``: the row
    mask alone when the chunks tile ``HEAD_DIM`` exactly (no per-lane compare then)."""
    if HEAD_DIM % BLOCK_D == 0:
        m_x = tl.broadcast_to(m_r[:, None], (BLOCK_R, BLOCK_D))
    else:
        m_x = m_r[:, None] & (i_d[None, :] < HEAD_DIM)
    return m_x
