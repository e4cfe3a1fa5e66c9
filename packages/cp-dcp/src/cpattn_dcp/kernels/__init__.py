"""``@triton.jit`` bodies of the DCP combine family. Local prefixes: ``i_`` indices, ``o_``
offsets, ``m_`` masks, ``b_`` register values.
"""
