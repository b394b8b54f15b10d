"""actor.use_torch_compile / ref.use_torch_compile (archer/models/compiled_layers.py) on the CPU: when the key
compiles (a GPU, without liger), one compiled graph for every layer and micro-batch size, and the actor's passes
with compiled layers (the key's GPU path, forced here on the CPU) against the eager ones: log-probs, entropies,
update metrics and weights. inductor's CPU kernels need a C++ compiler."""

from __future__ import annotations

import copy
import functools
import logging
import shutil

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from workers_support import compile_layers_as_on_a_gpu, ppo_config, unequal_batch, update

from archer.models import compiled_layers
from archer.models.compiled_layers import (
    checkpointing_forward,
    compile_decoder_layers,
    eager_layers,
    maybe_compile_layers,
)
from archer.models.loading import load_causal_lm
from archer.models.logprobs import layout_logprobs
from archer.models.sequence_layout import SequenceLayout
from archer.workers.actor import ActorWorker

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU kernels need a C++ compiler")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts from empty compile caches and counters (the layers of all models share one code object)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs dynamo compiled since the test began."""
    return int(counters["stats"]["unique_graphs"])


def rows(count: int, width: int, vocab: int, seed: int) -> SequenceLayout:
    """``count`` left-padded rows of random tokens, prompts of up to 4 and responses of up to ``width`` - 4."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 5, (count,), generator=gen)
    response = torch.randint(1, width - 3, (count,), generator=gen)
    prompt[0], response[0] = 4, width - 4  # the first row fills the width
    columns = torch.arange(width)
    mask = ((columns >= 4 - prompt[:, None]) & (columns < 4 + response[:, None])).long()
    ids = torch.randint(3, vocab, (count, width), generator=gen) * mask
    return SequenceLayout.build(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), width - 4, packed=False)


def test_one_graph_serves_every_layer_and_micro_batch_size(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device="cpu", gradient_checkpointing=True)
    assert compile_decoder_layers(model) == 2
    vocab = model.config.vocab_size
    # sizes unlike the model's (2, 4, 8, 32, 64: torch.compile would take an equal size for the same symbol)
    for count, width, seed in ((3, 11, 0), (5, 13, 1), (6, 17, 2), (3, 19, 3)):
        logp, ent = layout_logprobs(model, rows(count, width, vocab, seed))
        (logp.sum() + ent.sum()).backward()
        if seed == 0:
            first = graphs()
    assert first >= 1 and graphs() == first  # no recompile for new row counts and widths, none per layer
    model.eval()
    with torch.no_grad():  # eval without gradients: graphs of its own, the first time only
        layout_logprobs(model, rows(5, 9, vocab, 4))
        evaluated = graphs()
        layout_logprobs(model, rows(7, 14, vocab, 5))
    assert evaluated > first and graphs() == evaluated


def test_eager_layers_run_a_compiled_model_without_compiling(tiny_model_dir):
    eager = load_causal_lm(tiny_model_dir, device="cpu")
    model = load_causal_lm(tiny_model_dir, device="cpu")
    compile_decoder_layers(model)
    layout = rows(5, 12, model.config.vocab_size, 0)
    with eager_layers():
        got = layout_logprobs(model, layout)
    assert graphs() == 0
    want = layout_logprobs(eager, layout)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the same eager ops
    compiled = layout_logprobs(model, layout)
    assert graphs() >= 1
    for a, b in zip(compiled, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_deep_copy_of_a_compiled_model_runs_its_own_layers(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    compile_decoder_layers(model)
    twin = copy.deepcopy(model)
    assert all(layer.forward.__self__ is layer for layer in twin.model.layers)
    with torch.no_grad():
        for param in twin.model.layers[0].parameters():
            param.mul_(0.5)
    layout = rows(5, 12, model.config.vocab_size, 0)
    with eager_layers():
        assert not torch.allclose(layout_logprobs(model, layout)[0], layout_logprobs(twin, layout)[0])


def test_the_key_compiles_on_a_gpu_only_and_not_under_liger(tiny_model_dir, caplog):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    layers = list(model.model.layers)
    key = compiled_layers.ACTOR_KEY
    assert not maybe_compile_layers(model, CPU, enabled=True, liger=False, key=key)  # the CPU: no effect
    assert not maybe_compile_layers(model, torch.device("cuda"), enabled=False, liger=False, key=key)
    with caplog.at_level(logging.WARNING, logger="archer.models"):
        assert not maybe_compile_layers(model, torch.device("cuda"), enabled=True, liger=True, key=key)
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.actor.use_torch_compile=true leaves the decoder layers uncompiled: model.use_liger=true "
        "runs liger's kernels in them, which torch.compile cannot trace (set model.use_liger=false to compile them)"]
    assert all("forward" not in layer.__dict__ for layer in layers)  # nothing compiled so far
    # a CUDA device (the compile itself waits for the first call, so the CPU model serves here)
    assert maybe_compile_layers(model, torch.device("cuda"), enabled=True, liger=False, key=key)
    assert all("forward" in layer.__dict__ for layer in layers)


def test_the_reference_follows_the_actors_key_as_in_verl(tiny_model_dir):
    assert ppo_config(tiny_model_dir).actor_rollout_ref.ref.use_torch_compile is True
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.use_torch_compile=false")
    assert cfg.actor_rollout_ref.ref.use_torch_compile is False
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.ref.use_torch_compile=false")
    assert (cfg.actor_rollout_ref.actor.use_torch_compile, cfg.actor_rollout_ref.ref.use_torch_compile) == (True, False)


def compiled_actor(monkeypatch, model_dir, *overrides: str) -> ActorWorker:
    """An actor whose layers are compiled as the key compiles them on a GPU."""
    compile_layers_as_on_a_gpu(monkeypatch)
    actor = ActorWorker(ppo_config(model_dir, *overrides).actor_rollout_ref, device=CPU, total_steps=10)
    monkeypatch.undo()
    assert actor.compiled
    return actor


@pytest.mark.parametrize("layout", [
    # padded micro-batches of 4 rows, each layer's activations made again in the backward (compiled through it)
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",),
    # packed to 20 tokens, no checkpointing (on the CPU the packed attention runs eagerly between two graphs)
    ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
     "actor_rollout_ref.model.enable_gradient_checkpointing=false"),
])
def test_an_actor_with_compiled_layers_computes_what_the_eager_one_does(tiny_model_dir, monkeypatch, layout):
    overrides = ("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
                 "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                 "actor_rollout_ref.actor.use_kl_loss=true", *layout)
    eager = ActorWorker(ppo_config(tiny_model_dir, *overrides).actor_rollout_ref, device=CPU, total_steps=10)
    assert not eager.compiled  # the key is on by default, but this is the CPU
    actor = compiled_actor(monkeypatch, tiny_model_dir, *overrides)
    batch = unequal_batch(eager.model.config.vocab_size)
    want, got = eager.compute_log_prob(batch), actor.compute_log_prob(batch)
    assert graphs() >= 1
    for key in ("old_log_probs", "entropies"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    batch["old_log_probs"] = want["old_log_probs"] + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    batch["ref_log_prob"] = want["old_log_probs"]
    batch["advantages"] = torch.randn(6, 1, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
    want_metrics, got_metrics = update(eager, batch), update(actor, batch)
    assert want_metrics["actor/grad_norm"] > 0 and want_metrics["actor/pg_clipfrac"] > 0
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    moved = 0.0
    for (name, a), b, start in zip(actor.model.named_parameters(), eager.model.parameters(),
                                   load_causal_lm(tiny_model_dir, device="cpu").parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)
        moved = max(moved, float((b - start).abs().max()))
    assert moved > 1e-4  # the update moved the weights (by about the learning rate), so the match says something


class NewStyleLayer(nn.Module):
    """A layer as transformers >= 5.23 makes one: its own forward does the checkpointing (none here), torch's
    __call__."""

    gradient_checkpointing = False
    counts = True  # its forwards (a side effect that torch.compile would not trace into a checkpoint)

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.counts:
            self.forwards += 1
        return torch.tanh(self.proj(x)) * scale


class OldCheckpointingLayer(nn.Module):
    """transformers < 5.23's GradientCheckpointingLayer: its __call__ checkpoints torch's __call__ (around the
    forward)."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


class OldStyleLayer(OldCheckpointingLayer, NewStyleLayer):
    """A decoder layer of a transformers release before 5.23."""


class OwnCallLayer(NewStyleLayer):
    """A layer with a __call__ of its own (remote code): left as it is."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) + 1


@pytest.fixture()
def old_transformers(monkeypatch):
    monkeypatch.setattr(compiled_layers, "GradientCheckpointingLayer", OldCheckpointingLayer)


def test_checkpointing_moves_into_the_forward_of_a_layer_that_checkpoints_its_call(old_transformers):
    assert checkpointing_forward(NewStyleLayer) is NewStyleLayer
    assert checkpointing_forward(OwnCallLayer) is OwnCallLayer
    own = checkpointing_forward(OldStyleLayer)
    assert own.__call__ is nn.Module.__call__ and own.__name__ == "OldStyleLayer" and issubclass(own, OldStyleLayer)
    torch.manual_seed(0)
    plain, layer = NewStyleLayer(), OldStyleLayer()
    layer.load_state_dict(plain.state_dict())
    layer.__class__ = own
    seen = []

    def recorded(fn, *args):  # what the layer hands its checkpoint function: its own (raw) forward
        seen.append(fn.func)
        return checkpoint(fn, *args, use_reentrant=False)

    layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, recorded
    x = torch.randn(3, 4)
    for module in (plain, layer):
        (module(x, scale=2.0) ** 2).sum().backward()
    assert seen == [NewStyleLayer.forward] and layer.forwards == 2 and plain.forwards == 1  # recomputed once
    for a, b in zip(layer.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)
    with torch.no_grad():  # no backward to replay: no checkpoint
        layer(x)
    layer.eval()
    layer(x)
    assert len(seen) == 1 and layer.forwards == 4
    # compiled, the checkpoint is traced into the graph (no graph break) and gives the same gradients
    layer.train()
    layer.zero_grad()
    layer.counts = False
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    layer.forward = torch.compile(own.forward.__get__(layer), backend="aot_eager")
    (layer(x, scale=2.0) ** 2).sum().backward()
    assert not counters["graph_break"]
    for a, b in zip(layer.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)


def test_a_sharded_layers_class_still_finds_the_models_own_class(old_transformers):
    """FSDP2 makes FSDP<Layer>(FSDPModule, Layer) and finds Layer at a fixed place of the MRO (its __new__); the
    checkpointing subclass of a sharded layer moves that place one further."""
    sharded = type("FSDPOldStyleLayer", (FSDPModule, OldStyleLayer), {})
    own = checkpointing_forward(sharded)
    assert own.__mro__[own._orig_cls_mro_index] is OldStyleLayer
    assert sharded.__mro__[sharded._orig_cls_mro_index] is OldStyleLayer  # FSDP2's own class is left as it is
