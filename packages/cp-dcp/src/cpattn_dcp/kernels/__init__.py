"""``@triton.jit`` bodies of the DCP combine family (no torch-level logic here).

Prefix convention for locals: ``i_`` indices, ``o_`` offsets, ``m_`` masks, ``b_`` values
held in registers.
"""
