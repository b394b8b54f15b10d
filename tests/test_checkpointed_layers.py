"""actor_rollout_ref.model.gradient_checkpointing_layers (archer/models/checkpointed_layers.py): the key's values,
which layers recompute their forward in the backward, and an actor whose update checkpoints some layers against
one that checkpoints all or none (the memory plan's choice is tested in test_workers_memory.py)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from workers_support import ppo_config, unequal_batch, update

from archer.distributed.fsdp import decoder_layers
from archer.errors import ArcherError
from archer.models.checkpointed_layers import checkpoint_first_layers, requested_checkpointed_layers
from archer.models.compiled_layers import compile_decoder_layers
from archer.models.loading import load_causal_lm
from archer.workers.actor import ActorWorker

CPU = torch.device("cpu")


def model_cfg(**keys):
    return OmegaConf.create({"enable_gradient_checkpointing": True, **keys})


def test_the_key_values():
    assert requested_checkpointed_layers(model_cfg(), 28) is None  # absent: auto
    assert requested_checkpointed_layers(model_cfg(gradient_checkpointing_layers="auto"), 28) is None
    assert requested_checkpointed_layers(model_cfg(gradient_checkpointing_layers="all"), 28) == 28
    assert requested_checkpointed_layers(model_cfg(gradient_checkpointing_layers=0), 28) == 0
    assert requested_checkpointed_layers(model_cfg(gradient_checkpointing_layers=28), 28) == 28
    off = {"enable_gradient_checkpointing": False}
    assert requested_checkpointed_layers(model_cfg(**off, gradient_checkpointing_layers="auto"), 28) == 0
    assert requested_checkpointed_layers(model_cfg(**off, gradient_checkpointing_layers="all"), 28) == 0
    assert requested_checkpointed_layers(model_cfg(**off, gradient_checkpointing_layers=0), 28) == 0
    with pytest.raises(ArcherError, match="enable_gradient_checkpointing=false turns checkpointing off"):
        requested_checkpointed_layers(model_cfg(**off, gradient_checkpointing_layers=4), 28)
    for bad in (29, -1, "some", 2.5, True):
        with pytest.raises(ArcherError, match="is not auto, all or a number of decoder layers from 0 to 28") as err:
            requested_checkpointed_layers(model_cfg(gradient_checkpointing_layers=bad), 28)
        assert "gradient_checkpointing_layers=auto" in err.value.fix


def mlp_calls(model: torch.nn.Module) -> list[int]:
    """Counters of each decoder layer's MLP calls (a checkpointed layer's recompute calls its MLP again; a pre-hook,
    since the recompute stops once it has the last tensor the backward needs, inside the MLP)."""
    calls = [0] * len(decoder_layers(model))
    for index, layer in enumerate(decoder_layers(model)):
        layer.mlp.register_forward_pre_hook(lambda *_args, i=index: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("count", [0, 1, 2])
def test_only_the_first_count_layers_run_their_forward_again_in_the_backward(tiny_model_dir, count):
    model = load_causal_lm(tiny_model_dir, device="cpu", gradient_checkpointing=True)
    model.train()
    assert checkpoint_first_layers(model, count) == 2
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [i < count for i in range(2)]
    calls = mlp_calls(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    assert calls == [1, 1]
    logits.float().pow(2).mean().backward()
    assert calls == [2 if i < count else 1 for i in range(2)]


def actor(tiny_model_dir, layers: str) -> ActorWorker:
    overrides = ("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
                 "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                 f"actor_rollout_ref.model.gradient_checkpointing_layers={layers}")
    worker = ActorWorker(ppo_config(tiny_model_dir, *overrides).actor_rollout_ref, device=CPU, total_steps=10)
    worker.plan_checkpointing(None, announce=True)  # as the rank's workers do, here without a plan (a CPU)
    return worker


def test_an_actor_checkpointing_some_layers_updates_exactly_as_with_all_or_none(tiny_model_dir):
    workers = {layers: actor(tiny_model_dir, layers) for layers in ("all", "0", "1", "auto")}
    flags = {layers: [layer.gradient_checkpointing for layer in decoder_layers(w.model)] for layers, w in workers.items()}
    assert flags == {"all": [True, True], "0": [False, False], "1": [True, False], "auto": [True, True]}
    batch = unequal_batch(workers["all"].model.config.vocab_size)
    old = workers["all"].compute_log_prob(batch)["old_log_probs"]
    batch["old_log_probs"] = old + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    batch["advantages"] = torch.randn(6, 1, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
    metrics = {layers: update(w, batch) for layers, w in workers.items()}
    assert metrics["all"]["actor/grad_norm"] > 0 and metrics["all"]["actor/pg_clipfrac"] > 0
    for layers in ("0", "1", "auto"):
        assert metrics[layers] == metrics["all"], layers  # a recomputed forward is the same forward, bit for bit
        for a, b in zip(workers[layers].model.parameters(), workers["all"].model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_the_plans_count_is_applied_and_announced(tiny_model_dir, caplog):
    class Plan:  # the memory plan's two figures the actor reads
        checkpointed_layers = 1
        activations = 3 << 30

    worker = actor(tiny_model_dir, "auto")
    with caplog.at_level(logging.INFO, logger="archer.actor"):
        worker.plan_checkpointing(Plan(), announce=True)
    assert [layer.gradient_checkpointing for layer in decoder_layers(worker.model)] == [True, False]
    (message,) = [r.getMessage() for r in caplog.records if "gradient checkpointing" in r.getMessage()]
    assert message.startswith("gradient checkpointing on 1 of 2 decoder layers") and "3.0 GiB" in message
    assert "actor_rollout_ref.model.gradient_checkpointing_layers=all recomputes every layer" in message
    off = ActorWorker(ppo_config(tiny_model_dir, "actor_rollout_ref.model.enable_gradient_checkpointing=false")
                      .actor_rollout_ref, device=CPU, total_steps=10)
    off.plan_checkpointing(Plan(), announce=True)  # checkpointing off: the plan's count does not turn it on
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(off.model))
    off.cfg.model.gradient_checkpointing_layers = "some"  # refused even where checkpointing is off
    with pytest.raises(ArcherError, match="'some' is not auto, all or a number of decoder layers from 0 to 2"):
        off.plan_checkpointing(None, announce=True)


def test_the_plans_update_rows_are_applied_and_announced(tiny_model_dir, caplog):
    """Issue 44 point 3: ppo_micro_batch_size_per_gpu unset, the actor updates in the plan's rows per
    micro-batch (the whole mini-batch without a plan, on a CPU) and says so in one line."""
    from archer.workers.memory import MemoryPlan

    worker = actor(tiny_model_dir, "auto")
    assert worker.update_micro.rows is None
    plan = MemoryPlan(total=80 << 30, policy=0, gradients=0, optimizer=0, activations=0, engine_share=0,
                      engine_weights=0, engine_workspace=0, others={}, model_shape=(64, 128), longest=40,
                      checkpointed_layers=1, update_rows=2)
    with caplog.at_level(logging.INFO, logger="archer.actor"):
        worker.plan_micro_batches(plan, announce=True)
    assert worker.update_micro.rows == 2 and worker.update_micro.max_tokens is None
    (message,) = [r.getMessage() for r in caplog.records if "ppo_micro_batch_size_per_gpu is unset" in r.getMessage()]
    assert "micro-batches of 2 rows (the most, up to 80 tokens" in message and "1 of 2 decoder layers" in message


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes the forward saves for the backward outside checkpointed regions (a checkpointed layer saves only its
    input there), then the backward runs."""
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    return saved[0]


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU kernels need a C++ compiler")
def test_compiled_layers_checkpoint_per_layer_as_the_eager_ones(tiny_model_dir):
    """On a GPU the layers are compiled (actor.use_torch_compile): the per-layer flag is read inside the compiled
    forward, so each checkpointed layer saves less for the backward (0, 1 and 2 layers checkpointed save less and
    less, compiled as eager), with the eager layers' gradients."""
    torch._dynamo.reset()
    ids = torch.randint(3, 300, (3, 11), generator=torch.Generator().manual_seed(0))
    for compiled in (False, True):
        saved, grads = [], []
        for count in (0, 1, 2):
            model = load_causal_lm(tiny_model_dir, device="cpu", gradient_checkpointing=True)
            model.train()
            if compiled:
                compile_decoder_layers(model)
            checkpoint_first_layers(model, count)
            saved.append(saved_bytes(model, ids))
            grads.append([p.grad.clone() for p in model.parameters()])
        assert saved[0] > saved[1] > saved[2], (compiled, saved)
        for other in grads[1:]:
            for a, b in zip(other, grads[0], strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()
