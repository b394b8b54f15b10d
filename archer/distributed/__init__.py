"""Running archer's workers on several ranks: the process group and mesh (context), FSDP2 sharding with the
full-weight stream and gradient clipping (fsdp), sharded checkpoints and the HF export (checkpoint), and the
worker groups that call one worker per rank (dispatch, worker_group, ray_group).

Nothing here imports Ray at import time; the Ray worker group imports it when a run asks for world > 1.
"""
