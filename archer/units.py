"""Byte units shared by the memory plan, the fast engine's page budget and the step metrics."""

GIB = 1 << 30  # bytes in a GiB: memory figures are reported in GiB
