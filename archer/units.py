"""Byte units shared by the memory plan, the fast engine's page budget and the step metrics."""

MIB = 1 << 20  # bytes in a MiB (verl's "megabytes" keys)
GIB = 1 << 30  # bytes in a GiB: memory figures are reported in GiB
