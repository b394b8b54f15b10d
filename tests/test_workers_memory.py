"""The memory arithmetic of one GPU (workers/memory.py, rollout/fast/pages.py): verl's gpu_memory_utilization and the
memory plan, with the failures of issue 14 reproduced from their figures (an 80 GB H100: 79.2 GiB)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from workers_support import ppo_config

from archer.distributed.context import DistContext
from archer.errors import ArcherError
from archer.models.optim import LRSchedule
from archer.models.owner import ModelOwner
from archer.rollout.fast.engine import workspace_bytes
from archer.rollout.fast.model import ModelSpec, model_spec, weight_bytes
from archer.rollout.fast.pages import budget_pages, page_bytes
from archer.workers.memory import (
    CONTEXT_BYTES,
    GIB,
    MemoryPlan,
    activation_bytes,
    card_figures,
    held_elsewhere,
    micro_batch_tokens,
    no_grad_activation_bytes,
    no_grad_token_budget,
    plan_actor_memory,
)

H100 = int(79.2 * GIB)
BF16 = torch.bfloat16
CUDA = torch.device("cuda")  # only a name here: the CUDA calls are replaced by the card's recorded figures
CPU = torch.device("cpu")
# name: (hidden, layers, heads, kv heads, intermediate, tied embeddings)
SHAPES = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, True), "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, True),
          "qwen2.5-3b": (2048, 36, 16, 2, 11008, True), "qwen2.5-7b": (3584, 28, 28, 4, 18944, False)}
# grpo_vs_trl's workload: 16 prompts x 8 of 256 + 512 tokens, micro-batches of 32, no KL
WORKLOAD = ("data.train_batch_size=16", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "data.max_prompt_length=256",
            "data.max_response_length=512", "algorithm.adv_estimator=grpo")


def spec(name: str) -> ModelSpec:
    hidden, layers, heads, kv, inter, tied = SHAPES[name]
    return ModelSpec(model_type="qwen2", layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                     head_dim=hidden // heads, intermediate=inter, vocab=151936, eps=1e-6, qkv_bias=True,
                     o_bias=False, qk_norm=False, tied=tied)


def meta_model(name: str) -> Qwen2ForCausalLM:
    hidden, layers, heads, kv, inter, tied = SHAPES[name]
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=tied)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


class Card:
    """torch.cuda's memory calls on a card of ``total`` bytes where ``in_use`` bytes are taken, ``cached`` of them
    by the caching allocator's free blocks (given back by empty_cache)."""

    def __init__(self, monkeypatch, in_use_gib: float, held_gib: float, own_gib: float | None = None) -> None:
        """``own_gib``: what this process's allocator reserves once released (default: all that is held)."""
        self.in_use, self.held = int(in_use_gib * GIB), int(held_gib * GIB)
        self.own = self.held if own_gib is None else int(own_gib * GIB)
        self.released = False
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.own)

    def empty_cache(self) -> None:
        self.released = True

    def mem_get_info(self, device=None) -> tuple[int, int]:
        used = self.held if self.released else self.in_use
        return H100 - used, H100


def default_workspace(s: ModelSpec) -> int:
    return workspace_bytes(s, BF16, 1024, 8192)  # rollout.max_num_seqs / max_num_batched_tokens defaults


@pytest.mark.parametrize(("shape", "in_use", "held"), [
    ("qwen2.5-0.5b", 48.4, 6.4),   # bench/grpo_vs_trl.py at step 2: "48.4 GiB are in use"
    ("qwen2.5-0.5b", 45.6, 6.4),   # the other 0.5B workload
    ("qwen2.5-1.5b", 38.7, 20.2),  # the 1.5B shape at defaults: "38.7 GiB in use"
])
def test_the_engine_share_is_utilization_of_the_card_after_the_cache_is_released(monkeypatch, shape, in_use, held):
    """Issue 14's "no room for the fast engine's KV cache" at gpu_memory_utilization=0.5: the engine's share is
    0.5 x 79.2 GiB for its weights, workspace and KV cache, whatever the policy and its optimiser hold, sized
    after the update's cached blocks (most of the memory "in use") went back to the card."""
    card = Card(monkeypatch, in_use, held)
    s = spec(shape)
    workspace = default_workspace(s)
    assert round(workspace / GIB, 1) == (5.0 if shape == "qwen2.5-0.5b" else 5.3)  # "activations need 5.0 GiB"
    pages = budget_pages(s, 32, BF16, CUDA, 0.5, workspace, max_pages=10**9).pages
    assert card.released
    assert pages == int((0.5 * H100 - weight_bytes(s, BF16) - workspace) // page_bytes(s, 32, BF16))
    assert pages * page_bytes(s, 32, BF16) > 30 * GIB


def test_a_share_the_card_cannot_hold_shrinks_to_what_is_free(monkeypatch):
    """Issue 44: 60 GiB held by other things, so 0.5 x 79.2 GiB does not fit in the 19.2 GiB free: the cache takes
    what is free beside its workspace, down to one sequence of max_model_len tokens; below that one error."""
    Card(monkeypatch, 70.0, 60.0)
    s = spec("qwen2.5-0.5b")
    workspace, page = default_workspace(s), page_bytes(s, 32, BF16)
    budget = budget_pages(s, 32, BF16, CUDA, 0.5, workspace, 10**9, min_pages=65)
    assert budget.shrunk and budget.free == H100 - int(60.0 * GIB)
    assert budget.pages == int((H100 - 60.0 * GIB - workspace) // page)  # 19.2 GiB free less 5.0 of workspace
    assert budget.wanted == int((0.5 * H100 - weight_bytes(s, BF16) - workspace) // page)
    assert round(budget.pages * page / GIB, 1) == 14.2
    with pytest.raises(ArcherError, match=r"needs at least 15\.2 GiB \(one sequence of rollout.max_model_len") as err:
        budget_pages(s, 32, BF16, CUDA, 0.5, workspace, 10**9, min_pages=int(15.2 * GIB // page) + 1)
    assert "do not fit in the 19.2 GiB the GPU has free" in err.value.problem
    assert "optimizer_offload=true" in err.value.fix
    with pytest.raises(ArcherError, match="leaves no room for the fast engine's KV cache"):
        budget_pages(s, 32, BF16, CUDA, 0.06, workspace, 10**9)


def test_a_cache_that_fits_is_not_shrunk(monkeypatch):
    Card(monkeypatch, 30.0, 20.0)
    s = spec("qwen2.5-1.5b")
    budget = budget_pages(s, 32, BF16, CUDA, 0.5, default_workspace(s), max_pages=1000, min_pages=17)
    assert (budget.pages, budget.wanted, budget.shrunk) == (1000, 1000, False)


def test_weight_bytes_match_the_fast_models_tensors(tiny_model_dir):
    from archer.models.loading import load_causal_lm
    from archer.models.lora import policy_weights
    from archer.rollout.fast.model import FastModel

    model = load_causal_lm(tiny_model_dir, device="cpu")
    fast = FastModel(model, device=torch.device("cpu"), dtype=torch.float32, max_len=64)
    tensors = {id(t): t for t in [fast.embed, fast.lm_head, fast.norm]}
    for layer in fast.layers:
        tensors.update({id(t): t for t in vars(layer).values() if isinstance(t, torch.Tensor)})
    assert weight_bytes(fast.spec, torch.float32) == sum(t.numel() * 4 for t in tensors.values())
    fast.release()
    assert fast.released and fast.embed is None and not fast.layers
    fast.load(policy_weights(model))
    assert torch.equal(fast.embed, model.get_input_embeddings().weight)


def test_activation_estimate_by_hand():
    # 0.5B, 32 rows of 768 tokens: 24 layers x (34 x 896 + 10 x 4864) per token, plus 8 x 896 and two chunks
    tokens = 32 * 768
    full = tokens * (24 * (34 * 896 + 10 * 4864) + 8 * 896) + 2 * (256 << 20)
    ckpt = tokens * (24 * 4 * 896 + 34 * 896 + 10 * 4864 + 8 * 896) + 2 * (256 << 20)
    kwargs = {"hidden": 896, "intermediate": 4864, "layers": 24, "tokens": tokens}
    assert activation_bytes(**kwargs, checkpointed_layers=0) == full
    assert activation_bytes(**kwargs, checkpointed_layers=24) == ckpt
    # 10 layers checkpointed: their inputs and one of them recomputed at a time, 14 layers' saved tensors
    part = tokens * (10 * 4 * 896 + 14 * (34 * 896 + 10 * 4864) + (34 * 896 + 10 * 4864) + 8 * 896) + 2 * (256 << 20)
    assert activation_bytes(**kwargs, checkpointed_layers=10) == part


def test_micro_batch_tokens_follow_the_micro_batch_keys(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, *WORKLOAD).actor_rollout_ref
    assert micro_batch_tokens(cfg, 768) == 32 * 768
    whole = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
                       "data.train_batch_size=4").actor_rollout_ref
    assert micro_batch_tokens(whole, 100) == 4 * 2 * 100  # null: the whole mini-batch
    dynamic = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true").actor_rollout_ref
    assert micro_batch_tokens(dynamic, 100) == 16384
    assert micro_batch_tokens(dynamic, 20000) == 20000  # a longer row goes alone


ALL_LAYERS = "actor_rollout_ref.model.gradient_checkpointing_layers=all"  # verl's: every layer recomputed


def plan(tiny_model_dir, shape: str, *overrides: str) -> MemoryPlan:
    cfg = ppo_config(tiny_model_dir, *WORKLOAD, *overrides).actor_rollout_ref
    return plan_actor_memory(cfg, meta_model(shape), total=H100, fast_engine=True)


def test_the_15b_shape_fits_at_defaults_and_its_oom_is_caught_before_the_first_step(tiny_model_dir):
    """Issue 14, failure 2: the 1.5B shape ran out of memory in the update's forward (77.9 GiB allocated) with
    gradient checkpointing off and gpu_memory_utilization=0.8. At the defaults (checkpointing on, as verl) the
    plan fits; settings that cannot fit are refused before any step with the figures and the knob."""
    default = plan(tiny_model_dir, "qwen2.5-1.5b", ALL_LAYERS)
    default.check()
    params = sum(p.numel() for p in meta_model("qwen2.5-1.5b").parameters())
    assert (default.policy, default.gradients, default.optimizer) == (4 * params, 4 * params, 8 * params)
    # the cache is what max_num_seqs (1024) + 1 sequences of 768 tokens can use, less than the share leaves
    s = spec("qwen2.5-1.5b")
    assert default.kv_cache == default.kv_limit == (1025 * 24 + 1) * page_bytes(s, 32, BF16)
    assert default.kv_limit < int(0.5 * H100) - weight_bytes(s, BF16) - default_workspace(s)
    assert sum(default.generation().values()) == (4 + 8) * params + default.engine + CONTEXT_BYTES
    assert default.engine == weight_bytes(s, BF16) + default_workspace(s) + default.kv_limit
    assert sum(default.update().values()) < 40 * GIB
    # 0.8 fits too: the engine allocates no more cache than its 1024 slots of 768 tokens can use (21 GiB)
    plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8").check()
    longer = plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
                  "data.max_response_length=4096")  # 1025 x 4352 tokens would take the whole share
    with pytest.raises(ArcherError, match=r"cannot hold generation: it needs 81\.6 GiB"):  # 0.8 x 79.2 + 17.2 + 1
        longer.check()
    # the issue ran it with utilization 0.75 and checkpointing: checkpointing off is what the forward ran out of
    plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.rollout.gpu_memory_utilization=0.75").check()
    failing = plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                   "actor_rollout_ref.rollout.gpu_memory_utilization=0.75")
    assert failing.activations > 58 * GIB  # the OOM left 77.9 - 20.2 GiB of policy, Adam and engine for them
    with pytest.raises(ArcherError, match=r"cannot hold the policy update: it needs 1\d\d\.\d GiB") as err:
        failing.check()
    assert "policy 5.8, gradients 5.8, optimizer states 11.5, activations 9" in err.value.problem
    assert err.value.fix.startswith("try actor_rollout_ref.model.enable_gradient_checkpointing=true")


def test_auto_checkpoints_the_fewest_layers_whose_update_fits_with_a_margin(tiny_model_dir):
    """gradient_checkpointing_layers=auto (the default): the plan keeps the activations of as many layers as fit
    with the estimate taken 1 / 0.85 larger; more room (a sharded training state, no engine) leaves fewer layers
    checkpointed; a number is taken as given, and a plan that cannot fit with every layer checkpointed stays so."""
    every = plan(tiny_model_dir, "qwen2.5-1.5b", ALL_LAYERS)
    auto = plan(tiny_model_dir, "qwen2.5-1.5b")
    # 1.5B, 32 rows of 768 tokens on an H100: held beside the activations 24.0 GiB (policy, gradients, Adam, context)
    held = every.policy + every.gradients + every.optimizer + CONTEXT_BYTES
    shape = {"hidden": 1536, "intermediate": 8960, "layers": 28, "tokens": 32 * 768}

    def fewest(held: int, tokens: int = 32 * 768) -> int:
        return min(k for k in range(29)
                   if activation_bytes(**shape | {"tokens": tokens}, checkpointed_layers=k) <= (H100 - held) * 0.85)

    assert auto.checkpointed_layers == fewest(held) == 16  # of 28: 12 layers keep their activations
    assert auto.activations == activation_bytes(**shape, checkpointed_layers=16)
    assert activation_bytes(**shape, checkpointed_layers=15) > (H100 - held) * 0.85
    assert every.checkpointed_layers == 28 and every.activations < auto.activations
    auto.check()
    # a trainer rank of separate_async (no engine) over 2 shards: room for every layer's activations
    cfg = ppo_config(tiny_model_dir, *WORKLOAD).actor_rollout_ref
    trainer = plan_actor_memory(cfg, meta_model("qwen2.5-1.5b"), total=H100, fast_engine=False, shards=2)
    assert trainer.checkpointed_layers == fewest(-(-every.policy // 2) * 4 + CONTEXT_BYTES) == 13
    eight = plan_actor_memory(cfg, meta_model("qwen2.5-1.5b"), total=H100, fast_engine=False, shards=8)
    assert eight.checkpointed_layers < trainer.checkpointed_layers
    # the Archer2.0 recipe keeps the engine's 0.7 of each card (free_cache_engine=false): little room is left
    recipe = ppo_config(tiny_model_dir, *WORKLOAD, "actor_rollout_ref.rollout.free_cache_engine=false",
                        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "data.max_prompt_length=1024",
                        "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    kept = plan_actor_memory(recipe.actor_rollout_ref, meta_model("qwen2.5-1.5b"), total=H100, fast_engine=True,
                             shards=2)
    beside = kept.policy + kept.gradients + kept.optimizer + kept.engine + CONTEXT_BYTES
    assert kept.checkpointed_layers == fewest(beside, tokens=8 * 2048) == 27  # one layer keeps its activations
    given = plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.model.gradient_checkpointing_layers=20")
    assert given.checkpointed_layers == 20 and given.activations == activation_bytes(**shape, checkpointed_layers=20)
    off = plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.model.enable_gradient_checkpointing=false")
    assert off.checkpointed_layers == 0
    too_big = plan(tiny_model_dir, "qwen2.5-7b")  # 7B in full fine-tuning: nothing fits, every layer stays
    assert too_big.checkpointed_layers == 28


ISSUE_44 = ("data.train_batch_size=16", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "data.max_prompt_length=1536", "data.max_response_length=512", "algorithm.adv_estimator=grpo")


def test_unset_micro_batches_are_the_most_rows_that_fit(tiny_model_dir):
    """Issue 44 point 3: with ppo_micro_batch_size_per_gpu unset the plan runs the update in micro-batches of the
    most rows (up to 16,384 tokens) whose update fits the card with the activations' margin, not the whole
    mini-batch of 128 x 2,048 tokens (which no card holds); an explicit value is taken as given."""
    def issue_plan(*more: str, total: int = H100) -> MemoryPlan:
        cfg = ppo_config(tiny_model_dir, *ISSUE_44, *more).actor_rollout_ref
        return plan_actor_memory(cfg, meta_model("qwen2.5-1.5b"), total=total, fast_engine=True)

    chosen = issue_plan()
    assert chosen.update_rows == 8 == 16384 // 2048  # the token cap binds on an 80 GB card
    explicit = issue_plan("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    assert explicit.update_rows is None
    assert (chosen.activations, chosen.checkpointed_layers) == (explicit.activations, explicit.checkpointed_layers)
    chosen.check()
    whole = issue_plan("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128")
    with pytest.raises(ArcherError, match="cannot hold the policy update"):
        whole.check()
    # a 30 GiB card: room for fewer rows, every layer checkpointed; the count chosen fits, one more does not
    small = issue_plan(total=30 * GIB)
    assert small.update_rows is not None and 1 <= small.update_rows < 8
    held = small.policy + small.gradients + small.optimizer + CONTEXT_BYTES
    shape = {"hidden": 1536, "intermediate": 8960, "layers": 28}
    room = (30 * GIB - held) * 0.85
    assert activation_bytes(**shape, tokens=small.update_rows * 2048, checkpointed_layers=28) <= room
    assert activation_bytes(**shape, tokens=(small.update_rows + 1) * 2048, checkpointed_layers=28) > room
    assert small.checkpointed_layers == 28
    # a mini-batch smaller than the cap: all of it
    few = issue_plan("data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                     "actor_rollout_ref.rollout.n=4")
    assert few.update_rows == 4
    dynamic = issue_plan("actor_rollout_ref.actor.use_dynamic_bsz=true")  # a token budget: as the keys say
    assert dynamic.update_rows is None


def test_the_05b_shape_fits_at_defaults_and_without_checkpointing(tiny_model_dir):
    plan(tiny_model_dir, "qwen2.5-0.5b").check()
    plan(tiny_model_dir, "qwen2.5-0.5b", "actor_rollout_ref.model.enable_gradient_checkpointing=false").check()


def test_a_7b_full_fine_tune_names_the_offload_knobs(tiny_model_dir):
    full = plan(tiny_model_dir, "qwen2.5-7b")
    with pytest.raises(ArcherError, match="cannot hold generation") as err:
        full.check()
    assert "optimizer states 56." in err.value.problem
    assert err.value.fix.startswith("try actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    offloaded = plan(tiny_model_dir, "qwen2.5-7b", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                     "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    assert offloaded.generation()["policy"] == 0 and offloaded.generation()["optimizer states"] == 0
    with pytest.raises(ArcherError, match="cannot hold the policy update"):  # 7B x 16 bytes > 80 GB: LoRA
        offloaded.check()


def test_free_cache_engine_false_keeps_the_engine_in_the_update(tiny_model_dir):
    plan(tiny_model_dir, "qwen2.5-3b").check()
    kept = plan(tiny_model_dir, "qwen2.5-3b", "actor_rollout_ref.rollout.free_cache_engine=false")
    assert kept.update()["engine (free_cache_engine=false)"] == kept.engine > 30 * GIB
    with pytest.raises(ArcherError, match="cannot hold the policy update") as err:
        kept.check()
    assert "rollout.free_cache_engine=true" in err.value.fix


def test_no_grad_budget_by_hand():
    per_token = 24 * 1536 + 8 * 8960  # 1.5B: one layer's tensors at a time
    chunks = 2 * (256 << 20)
    assert no_grad_activation_bytes(hidden=1536, intermediate=8960, tokens=1000) == 1000 * per_token + chunks
    # 0.8 of the room, less the two logit chunks, in tokens; at least the longest row, at most 65536
    shape = {"hidden": 1536, "intermediate": 8960, "longest": 2048}
    assert no_grad_token_budget(5 * GIB, **shape) == (int(4 * GIB) - chunks) // per_token == 34622
    assert no_grad_token_budget(10 * GIB, **shape) == 65536  # 74191 tokens would fit: the cap
    assert no_grad_token_budget(0, **shape) == 2048
    assert no_grad_token_budget(1000 * GIB, **shape) == 65536


def test_the_no_grad_stage_of_the_plan(tiny_model_dir):
    default = plan(tiny_model_dir, "qwen2.5-1.5b")
    # the engine is released (free_cache_engine) and the gradients are gone: policy, Adam's states, the context
    assert default.no_grad_held() == {"policy": default.policy, "optimizer states": default.optimizer,
                                      "CUDA context": CONTEXT_BYTES, "other processes": 0}
    assert default.no_grad_room() == H100 - default.policy - default.optimizer - CONTEXT_BYTES
    assert default.no_grad_tokens() == 65536  # 60.9 GiB of room: the cap
    assert default.no_grad()["no-grad activations"] == no_grad_activation_bytes(hidden=1536, intermediate=8960,
                                                                                 tokens=65536)
    assert default.no_grad_tokens(hidden=896, intermediate=4864) == 65536  # a smaller model (a reward model)
    # Archer2.0's recipe on its two cards: the engine keeps 0.7 of each through every stage, 2048-token rows
    cfg = ppo_config(tiny_model_dir, *WORKLOAD, "actor_rollout_ref.rollout.free_cache_engine=false",
                     "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "data.max_prompt_length=1024",
                     "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    recipe = plan_actor_memory(cfg.actor_rollout_ref, meta_model("qwen2.5-1.5b"), total=H100, fast_engine=True,
                               shards=2)
    recipe.check()
    room = H100 - recipe.policy - recipe.optimizer - recipe.engine - CONTEXT_BYTES
    assert recipe.no_grad_room() == room and 14 * GIB < room < 15 * GIB
    assert recipe.no_grad_tokens() == 65536  # (0.8 x 14.1 GiB - 0.5 GiB) / 108544 bytes would be 106k tokens
    kept = plan_actor_memory(cfg.actor_rollout_ref, meta_model("qwen2.5-1.5b"), total=H100, fast_engine=True)
    kept_room = H100 - kept.policy - kept.optimizer - kept.engine - CONTEXT_BYTES  # one card: 5.5 GiB
    assert kept.no_grad_room() == kept_room and 5 * GIB < kept_room < 6 * GIB
    assert kept.no_grad_tokens() == no_grad_token_budget(kept_room, hidden=1536, intermediate=8960, longest=2048)
    assert kept.no_grad_tokens() == 38640
    offloaded = plan(tiny_model_dir, "qwen2.5-1.5b", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    assert offloaded.no_grad_held()["optimizer states"] == 0


def test_a_no_grad_stage_that_cannot_hold_its_longest_row_is_refused():
    # a 1.5B policy without an engine on a 20 GiB card: generation holds 19 GiB, a no-grad pass of one
    # 32768-token row needs 3.8 GiB more
    card = MemoryPlan(total=20 * GIB, policy=6 * GIB, gradients=6 * GIB, optimizer=12 * GIB, activations=GIB,
                      engine_share=0, engine_weights=0, engine_workspace=0, others={}, model_shape=(1536, 8960),
                      longest=32768)
    assert card.no_grad_tokens() == 32768
    with pytest.raises(ArcherError, match=r"cannot hold the no-grad passes: it needs 22\.\d GiB") as err:
        card.check()
    assert "no-grad activations 3.8" in err.value.problem
    assert err.value.fix.startswith("try actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    assert "ppo_micro_batch_size_per_gpu" not in err.value.fix  # the update's knob does not help here


def test_model_spec_of_the_meta_model_matches_the_hand_spec():
    assert model_spec(meta_model("qwen2.5-1.5b")) == spec("qwen2.5-1.5b")


def lora_llama_8b() -> LlamaForCausalLM:
    """LLaMA 3.1 8B's shape (bench/model_sizes.py's row) on the meta device: a bf16 base with rank-64 adapters."""
    from archer.models.lora import LoraSettings, add_lora

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(BF16)
    add_lora(model, LoraSettings(64, 32.0, "all-linear"))
    return model


def test_the_8b_lora_failure_is_another_process_memory_named_at_run_time(monkeypatch):
    """Issue 14's 8B LoRA row stopped with "the fast engine's KV cache (19.2 GiB) and activations (5.4 GiB) do not
    fit in the 11.4 GiB the GPU has free (... 67.7 GiB are held by the policy, its optimiser and other models)".
    The run itself held 31.2 GiB (bf16 base 15.0, adapters 0.6, the engine's bf16 copy 15.0, rope tables and
    rounding); the rest was bench/model_sizes.py's own process, whose caching allocator kept the blocks of the
    model it had drawn on the GPU (measured: 30.9 GiB reserved after drawing the 8B shape). The error now says
    which is which. Since issue 44 the cache shrinks to the 6.0 GiB beside the workspace; where even one sequence of
    max_model_len tokens does not fit there, the error says the same."""
    model = lora_llama_8b()
    s = model_spec(model)
    workspace = workspace_bytes(s, BF16, 1024, 8192)
    assert round(workspace / GIB, 1) == 5.4
    assert round((0.5 * H100 - weight_bytes(s, BF16) - workspace) / GIB, 1) == 19.2  # the KV cache of the error
    Card(monkeypatch, 67.8, 67.8, own_gib=31.2)
    page = page_bytes(s, 32, BF16)
    budget = budget_pages(s, 32, BF16, CUDA, 0.5, workspace, max_pages=10**9, min_pages=129)
    assert budget.shrunk and round(budget.pages * page / GIB, 1) == 6.0
    with pytest.raises(ArcherError, match=r"do not fit in the 11\.4 GiB the GPU has free") as err:
        budget_pages(s, 32, BF16, CUDA, 0.5, workspace, max_pages=10**9, min_pages=int(6.5 * GIB // page))
    assert "31.2 GiB are held by this process's tensors" in err.value.problem
    assert "36.6 GiB by CUDA contexts and other processes" in err.value.problem
    assert "nvidia-smi" in err.value.fix


def test_held_elsewhere_by_hand():
    # the fixed 8B run on the H100 at the actor's plan: 62.34 GiB free, 15.64 reserved by the run's allocator
    assert round(held_elsewhere(total=H100, free=int(62.34 * GIB), reserved=int(15.64 * GIB)) / GIB, 2) == 0.22
    assert held_elsewhere(total=H100, free=int(70 * GIB), reserved=int(15 * GIB)) == 0  # never negative


def test_card_figures_give_back_the_cache_first(monkeypatch):
    card = Card(monkeypatch, 60.0, 48.0, own_gib=15.0)
    total, elsewhere = card_figures(CUDA)
    assert card.released and total == H100
    assert elsewhere == int(48.0 * GIB) - int(15.0 * GIB) - CONTEXT_BYTES


def test_the_8b_lora_plan_counts_other_processes_and_refuses_what_would_fail_at_run_time(tiny_model_dir):
    """A plan that passes must not fail at run time: with the bench's drawing process holding 31.5 GiB (30.9
    reserved and its context) the 8B LoRA row cannot fit, and the plan says so before any step, naming the
    other processes; on a card of its own (0.2 GiB elsewhere, as measured) it fits, as it ran (52.6 GiB peak)."""
    cfg = ppo_config(tiny_model_dir, *WORKLOAD, "actor_rollout_ref.model.lora_rank=64",
                     "actor_rollout_ref.model.lora_alpha=32").actor_rollout_ref
    model = lora_llama_8b()
    alone = plan_actor_memory(cfg, model, total=H100, fast_engine=True, elsewhere=int(0.2 * GIB))
    alone.check()
    adapters = 32 * 64 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert alone.optimizer == 8 * adapters and alone.gradients == 4 * adapters
    assert alone.policy == 2 * 8030261248 + 4 * adapters  # the bf16 base (LLaMA 3.1 8B) and fp32 adapters
    generation = sum(alone.generation().values())
    assert 52.6 * GIB < generation < 60 * GIB  # the measured peak, under the plan
    shared = plan_actor_memory(cfg, model, total=H100, fast_engine=True, elsewhere=int(31.5 * GIB))
    with pytest.raises(ArcherError, match="cannot hold generation") as err:
        shared.check()
    assert "other processes 31.5" in err.value.problem
    assert "other processes do not use (they hold 31.5 GiB" in err.value.fix


def test_sharded_ranks_hold_their_share_of_the_training_state_and_a_whole_engine(tiny_model_dir):
    """With FSDP2 over 8 ranks each card holds 1/8 of the policy, its gradients and Adam's states; the engine's
    weights and the activations stay whole; the models beside it are taken as they sit on the card (the critic's
    1/8, test_models_beside_the_actor_count_their_share_of_the_card). The 7B shape in full fine-tuning does not
    fit one card but fits 8."""
    cfg = ppo_config(tiny_model_dir, *WORKLOAD, ALL_LAYERS).actor_rollout_ref
    model = meta_model("qwen2.5-1.5b")
    one = plan_actor_memory(cfg, model, total=H100, fast_engine=True, others={"critic": 16 * 10**9})
    eight = plan_actor_memory(cfg, model, total=H100, fast_engine=True, others={"critic": 2 * 10**9}, shards=8)
    assert (eight.policy, eight.gradients, eight.optimizer) == (-(-one.policy // 8), -(-one.gradients // 8),
                                                                -(-one.optimizer // 8))
    assert eight.others == {"critic": 2 * 10**9} and eight.update()["critic"] == 2 * 10**9
    assert (eight.engine_weights, eight.activations) == (one.engine_weights, one.activations)
    big = ppo_config(tiny_model_dir, *WORKLOAD).actor_rollout_ref
    with pytest.raises(ArcherError):
        plan_actor_memory(big, meta_model("qwen2.5-7b"), total=H100, fast_engine=True).check()
    plan_actor_memory(big, meta_model("qwen2.5-7b"), total=H100, fast_engine=True, shards=8).check()


def test_the_models_beside_the_actor_are_held_in_both_stages():
    """The reference, critic and reward model stay on the card while the engine generates and during the
    update; figures by hand (GiB): the update holds 10 + 10 + 30 + 4 + 20 + 5 + 1 = 80, generation 10 + 20 + 30
    + 4 + 1 = 65, so a 79 GiB card holds generation but not the update, and only because of the others."""
    others = {"critic": 30 * GIB, "reward model": 4 * GIB}
    plan = MemoryPlan(total=79 * GIB, policy=10 * GIB, gradients=10 * GIB, optimizer=20 * GIB, activations=5 * GIB,
                      engine_share=0, engine_weights=0, engine_workspace=0, others=others,
                      model_shape=(1536, 8960), longest=2048)
    assert plan.update() == {"policy": 10 * GIB, "gradients": 10 * GIB, **others, "optimizer states": 20 * GIB,
                             "activations": 5 * GIB, "CUDA context": GIB, "other processes": 0}
    assert plan.generation() == {"policy": 10 * GIB, "optimizer states": 20 * GIB, **others, "CUDA context": GIB,
                                 "other processes": 0}
    with pytest.raises(ArcherError, match=r"cannot hold the policy update: it needs 80\.0 GiB") as err:
        plan.check()
    assert "critic 30.0, reward model 4.0" in err.value.problem
    MemoryPlan(**{**vars(plan), "others": {}}).check()  # alone, the actor fits


def test_models_beside_the_actor_count_their_share_of_the_card():
    """ModelOwner.card_bytes, what the rank's plan takes for each model beside the actor: the weights, and with an
    optimiser their gradients and Adam's two states (the critic's 16 bytes per float32 parameter); 1/8 of it on
    each of 8 ranks."""
    owner = ModelOwner(meta_model("qwen2.5-1.5b"), device=CUDA)
    params = sum(p.numel() for p in owner.model.parameters())
    assert owner.card_bytes() == 4 * params  # frozen float32 weights only
    owner.attach_optimizer(OmegaConf.create({"lr": 1e-6, "weight_decay": 0.0}), LRSchedule("constant", 0, 10))
    assert owner.card_bytes() == 16 * params
    owner.ctx = DistContext(rank=0, world_size=8, local_rank=0, device=CUDA)  # the figures of one rank of 8
    assert owner.card_bytes() == -(-16 * params // 8)


def test_the_rank_plan_takes_each_model_beside_the_actor_from_its_worker(tiny_model_dir):
    """models_beside_actor: the reference's own copy and the critic with its training state (a LoRA policy's
    reference is its own module: nothing beside it); the reward model's bytes are test_reward_model's."""
    from archer.workers.actor import ActorWorker
    from archer.workers.colocated import models_beside_actor
    from archer.workers.critic import CriticWorker

    cfg = ppo_config(tiny_model_dir, "algorithm.adv_estimator=gae")
    actor = ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=1, start_rollout=False)
    assert actor.rollout is None  # the engine waits for the plan
    ref = actor.make_reference()
    critic = CriticWorker(cfg.critic, rollout_n=1, device=CPU, total_steps=1)
    ref_params = sum(p.numel() for p in ref.model.parameters())
    critic_params = sum(p.numel() for p in critic.model.parameters())
    assert models_beside_actor(ref, critic, None) == {"reference policy": 4 * ref_params,  # float32 on the CPU
                                                      "critic": 16 * critic_params}
    lora = ppo_config(tiny_model_dir, "actor_rollout_ref.model.lora_rank=4")
    lora_actor = ActorWorker(lora.actor_rollout_ref, device=CPU, total_steps=1, start_rollout=False)
    assert models_beside_actor(lora_actor.make_reference(), None, None) == {}
