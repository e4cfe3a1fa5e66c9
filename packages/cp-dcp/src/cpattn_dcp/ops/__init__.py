"""Typed launchers, validation and ``torch.library`` registration of the DCP combine ops."""
