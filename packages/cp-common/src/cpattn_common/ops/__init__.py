"""Torch-level ops of cpattn_common: validation, typed launchers, ``torch.library`` registration."""
