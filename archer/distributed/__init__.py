"""Running archer's workers on several ranks: process groups, FSDP2 sharding, checkpoints and worker groups.

Nothing here imports Ray at import time; the Ray worker group imports it when a run asks for world > 1.
"""
