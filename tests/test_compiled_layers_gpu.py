"""actor.use_torch_compile on a CUDA GPU (archer/models/compiled_layers.py): the packed micro-batches' flash varlen
attention inside compiled layers, one graph for every token count, row count and longest row, log-probs and
gradients against the eager layers under bf16 autocast, and the actor compiling by default. Skipped without a GPU;
run on the device machine."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import Qwen2Config, Qwen2ForCausalLM
from workers_support import ppo_config, unequal_batch, update

from archer.models.compiled_layers import compile_decoder_layers
from archer.models.loading import autocast_for, set_gradient_checkpointing
from archer.models.logprobs import layout_logprobs
from archer.models.packed_attention import use_packed_attention
from archer.models.sequence_layout import SequenceLayout
from archer.workers.actor import ActorWorker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def packed_rows(lengths: list[int], prompt: int, vocab: int, seed: int) -> SequenceLayout:
    """Rows of ``lengths`` tokens from column 0 (the first ``prompt`` the prompt), packed."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    columns = torch.arange(width)
    mask = torch.stack([(columns < length).long() for length in lengths])
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen) * mask
    return SequenceLayout.build(ids.to(CUDA), mask.to(CUDA), (mask.cumsum(1) - 1).clamp(min=0).to(CUDA),
                                width - prompt, packed=True)


def wide_model() -> Qwen2ForCausalLM:
    """Two decoder layers of Qwen2.5-1.5B's width (float32 weights, as the actor keeps them), checkpointed."""
    config = Qwen2Config(vocab_size=1024, hidden_size=1536, num_hidden_layers=2, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(CUDA)
    use_packed_attention(model)
    set_gradient_checkpointing(model, True)
    return model


def test_packed_micro_batches_of_every_size_share_one_graph_and_match_eager():
    torch._dynamo.reset()
    counters.clear()
    eager = wide_model()
    model = copy.deepcopy(eager)
    compile_decoder_layers(model)
    graphs = []
    # token counts (500 to 9,000: across inductor's size thresholds, archer/models/compiled_layers.py), row counts
    # and longest rows all new each time (the longest row would fix a graph if read as a Python int)
    for seed, lengths in enumerate([[37, 300, 11, 150], [1200, 5, 610, 330, 1700, 1000], [9, 13, 480],
                                    [2000, 170, 440, 3, 990, 1500, 2100, 1800], [4000, 60, 900]]):
        layout = packed_rows(lengths, 3, 1024, seed)
        outputs = []
        for net in (model, eager):
            net.zero_grad()
            with autocast_for(CUDA):
                logp, ent = layout_logprobs(net, layout)
            (logp.float().sum() + ent.float().sum()).backward()
            outputs.append((logp.float(), ent.float(), net.model.layers[0].mlp.up_proj.weight.grad.clone()))
        graphs.append(int(counters["stats"]["unique_graphs"]))
        (got_logp, got_ent, got_grad), (want_logp, want_ent, want_grad) = outputs
        torch.testing.assert_close(got_logp, want_logp, atol=5e-2, rtol=0)  # bf16 rounding of fused ops
        torch.testing.assert_close(got_ent, want_ent, atol=5e-2, rtol=0)
        assert float((got_grad - want_grad).norm() / want_grad.norm()) < 3e-2
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), graphs


def test_the_actor_compiles_its_layers_by_default_and_updates_as_the_eager_one(tiny_model_dir):
    overrides = ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                 "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20", "actor_rollout_ref.actor.optim.lr=1e-4")
    compiled = ActorWorker(ppo_config(tiny_model_dir, *overrides).actor_rollout_ref, device=CUDA, total_steps=10)
    eager = ActorWorker(ppo_config(tiny_model_dir, *overrides, "actor_rollout_ref.actor.use_torch_compile=false")
                        .actor_rollout_ref, device=CUDA, total_steps=10)
    assert compiled.compiled and not eager.compiled
    batch = unequal_batch(eager.model.config.vocab_size)
    want, got = eager.compute_log_prob(batch), compiled.compute_log_prob(batch)
    torch.testing.assert_close(got["old_log_probs"], want["old_log_probs"], atol=3e-2, rtol=0)
    batch["old_log_probs"] = want["old_log_probs"]
    batch["advantages"] = torch.randn(6, 1, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
    want_metrics, got_metrics = update(eager, batch), update(compiled, batch)
    assert got_metrics.keys() == want_metrics.keys()
    assert got_metrics["actor/grad_norm"] == pytest.approx(want_metrics["actor/grad_norm"], rel=5e-2)
