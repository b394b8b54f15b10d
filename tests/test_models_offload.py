"""verl's param_offload / optimizer_offload (models/offload.py): the same training with and without them, and
where the tensors live while they are offloaded."""

from __future__ import annotations

import pytest
import torch
from workers_support import ppo_config

from archer.batch import Batch
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.offload import Offload
from archer.workers.actor import ActorWorker

CPU = torch.device("cpu")
OFFLOAD = "actor_rollout_ref.actor.fsdp_config"


def prompts(model_dir, seed: int) -> Batch:
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(["what is 3 + 5?", "hi there", "count to four"])["input_ids"]
    width = max(map(len, ids))
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    return Batch({"input_ids": torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in ids]),
                  "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                 {"uid": ["a", "b", "c"]}, {"validate": False, "seed": seed})


def train(model_dir, *overrides: str) -> tuple[ActorWorker, list[dict[str, float]], list[bool]]:
    """Two steps of generate -> old log-probs -> update with the fast engine (which holds its own weights);
    returns the actor, the update metrics, and for each generation whether every policy weight was in its host
    buffer meanwhile."""
    cfg = ppo_config(model_dir, "actor_rollout_ref.rollout.name=fast", "actor_rollout_ref.rollout.n=2",
                     "data.max_response_length=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                     "data.train_batch_size=3", "actor_rollout_ref.actor.optim.lr=1e-2", *overrides)
    torch.manual_seed(0)
    actor = ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=2)
    engine = actor.rollout.engine
    generate, offloaded = engine.generate, []

    def recording_generate(*args, **kwargs):
        buffers = actor.owner.offload.copies.buffers
        offloaded.append(all(("param", i) in buffers and p.data_ptr() == buffers[("param", i)].data_ptr()
                             for i, p in enumerate(actor.owner.offload.params)))
        return generate(*args, **kwargs)

    engine.generate = recording_generate
    metrics = []
    for step in range(2):
        batch = actor.generate_sequences(prompts(model_dir, seed=step))
        batch = batch.union(actor.compute_log_prob(batch))
        batch["advantages"] = torch.linspace(-0.5, 1.5, len(batch)).unsqueeze(1) * batch["response_mask"]
        metrics.append(actor.update_actor(batch).metrics)
    return actor, metrics, offloaded


def test_offload_trains_exactly_as_without(tiny_model_dir):
    plain, plain_metrics, plain_offloaded = train(tiny_model_dir)
    both, both_metrics, both_offloaded = train(tiny_model_dir, f"{OFFLOAD}.param_offload=true",
                                               f"{OFFLOAD}.optimizer_offload=true")
    assert plain_offloaded == [False, False] and both_offloaded == [True, True]
    for a, b in zip(plain_metrics, both_metrics, strict=True):
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-6)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)
    for (name, p), q in zip(plain.model.named_parameters(), both.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    start = load_causal_lm(tiny_model_dir, device=CPU)
    assert not torch.allclose(start.lm_head.weight, both.model.lm_head.weight, atol=1e-4)  # the weights did move
    buffers = both.owner.offload.copies.buffers
    states = [both.optimizer.state[p] for p in both.owner.offload.params]
    assert all(s["exp_avg"].data_ptr() == buffers[("state", i, "exp_avg")].data_ptr() for i, s in enumerate(states))
    assert all(s["exp_avg_sq"].data_ptr() == buffers[("state", i, "exp_avg_sq")].data_ptr()
               for i, s in enumerate(states))


def test_offloaded_tensors_live_on_the_host_device():
    """A meta host shows which optimiser tensors move (values are not kept on meta); parameters move into their
    host buffers in place."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    offload = Offload(model.parameters(), optimizer, CPU, param_offload=True, optimizer_offload=True,
                      host=torch.device("meta"))
    offload.optimizer_to_host()
    for state in optimizer.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert not state["step"].is_meta  # Adam's step count stays where the optimiser keeps it

    for p in model.parameters():
        p.grad = None
    values = [p.detach().clone() for p in model.parameters()]
    params = Offload(model.parameters(), optimizer, CPU, param_offload=True, optimizer_offload=False)
    params.params_to_host()  # into fresh host buffers: the same Parameter objects, the same values
    assert all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"], strict=True))
    for i, (p, v) in enumerate(zip(model.parameters(), values, strict=True)):
        assert p.data_ptr() == params.copies.buffers[("param", i)].data_ptr() and torch.equal(p, v)


def test_nothing_moves_without_the_keys():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    offload = Offload(model.parameters(), optimizer, CPU, param_offload=False, optimizer_offload=False,
                      host=torch.device("meta"))
    offload.params_to_host()
    with offload.optimizer_step():
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert not model.weight.is_meta and not optimizer.state[model.weight]["exp_avg"].is_meta
    assert not offload.copies.buffers
