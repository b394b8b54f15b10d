"""Whether archer still refuses more than one device: the one switch of the tests that exercise world > 1
through the user-facing interface (test_examples' multi-GPU case, test_bench_scale_out's world 2)."""

from __future__ import annotations

from archer.config.no_ops import NO_OPS


def multi_gpu_refused() -> bool:
    """Whether archer still refuses trainer.n_gpus_per_node > 1 (its entry in archer/config/no_ops.py).

    COORDINATOR: when world > 1 lands and that entry (or its refusal) goes, this turns False by itself and the
    tests that call it check the multi-GPU runs themselves (examples' ``--cfg job`` at 8 GPUs per node,
    bench/scale_out.py's world 2 on CPU worker processes) instead of the refusal."""
    entry = next((e for e in NO_OPS if e.key == "trainer.n_gpus_per_node"), None)
    return entry is not None and entry.refuse is not None and entry.refuse(8)
