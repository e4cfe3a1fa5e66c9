"""Thin typed wrappers over the group collectives the DCP combines use (``collectives``), and
group resolution with the string tokens the registered ops carry (``groups``)."""
