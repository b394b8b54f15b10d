"""One model over several processes: the process group and mesh (context), FSDP2 sharding with gradient
clipping (fsdp), and sharded checkpoints (sharded_checkpoint). Below archer.models, which uses them; the worker
groups that start the ranks are archer.controller's.
"""
