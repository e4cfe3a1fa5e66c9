"""``@triton.jit`` bodies only (no torch-level logic); launched by ``cpattn_common.ops``."""
