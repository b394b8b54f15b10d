"""separate_async's balance figures (archer/trainer/separate_rollout.PipelineBalance), by hand: the rollout ranks'
idle time, the step's period, and the one hint naming which GPUs to move."""

from __future__ import annotations

from archer.trainer.separate_rollout import PipelineBalance


def feed(balance: PipelineBalance, steps: list[tuple[float, float, float, float]]) -> list[tuple[dict, str | None]]:
    out = []
    for launched, asked, generation_s, wait_s in steps:
        metrics: dict[str, float] = {}
        out.append((metrics, balance.observe(launched, asked, generation_s, wait_s, metrics)))
    return out


def test_rollout_gpus_that_idle_three_steps_in_a_row_get_one_hint_to_move_a_gpu_to_training() -> None:
    balance = PipelineBalance(trainer_gpus=2, rollout_gpus=2)
    # each call is launched at t, generates 4 s, and is asked for at t + 10 (the trainer's 10 s step): 6 s idle
    steps = [(10.0 * k, 10.0 * k + 10, 4.0, 0.0) for k in range(5)]
    results = feed(balance, steps)
    assert [m["async/rollout_idle_s"] for m, _ in results] == [6.0] * 5
    hints = [hint for _, hint in results]
    assert hints[:3] == [None, None, None]  # the first take has no period; then two steps of 60% idle
    assert hints[3] is not None and "rollout GPU(s) idled 60% of the last step" in hints[3]
    assert "trainer.n_gpus_per_node + 1, actor_rollout_ref.rollout.n_gpus_per_node - 1" in hints[3]
    assert hints[4] is None  # once a run


def test_a_trainer_that_waits_gets_the_other_hint_and_a_balanced_pipeline_none() -> None:
    waiting = PipelineBalance(trainer_gpus=3, rollout_gpus=1)
    # the trainer asks 2 s after each launch and waits 4 s for the 6 s generation: period 6 s, 67% waiting
    results = feed(waiting, [(6.0 * k, 6.0 * k + 2, 6.0, 4.0) for k in range(4)])
    assert [m["async/rollout_idle_s"] for m, _ in results] == [0.0] * 4
    assert results[3][1] is not None and "waited for generation 67% of the last step" in results[3][1]
    assert "actor_rollout_ref.rollout.n_gpus_per_node + 1, trainer.n_gpus_per_node - 1" in results[3][1]
    balanced = PipelineBalance(trainer_gpus=2, rollout_gpus=2)
    assert all(hint is None for _, hint in feed(balanced, [(8.0 * k, 8.0 * k + 7.5, 7.0, 0.5) for k in range(6)]))
    lone = PipelineBalance(trainer_gpus=1, rollout_gpus=1)  # no GPU to move: no hint
    assert all(hint is None for _, hint in feed(lone, [(10.0 * k, 10.0 * k + 10, 4.0, 0.0) for k in range(6)]))
