"""Running one model over several processes: the process group and mesh (context), FSDP2 sharding with the
full-weight stream and gradient clipping (fsdp), sharded checkpoints and the HF export (checkpoint)."""
