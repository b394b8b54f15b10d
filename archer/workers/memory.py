"""The memory plan of an RL step on one GPU: what each stage holds on the card, checked before any step runs.

The rank's colocated workers (workers/colocated.py) make it: they know every model on the card (the actor's
policy, and beside it the reference, the critic and the reward model as each sits there, ``ModelOwner.card_bytes``)
and check the plan before the actor's engine takes its share.

verl's ``rollout.gpu_memory_utilization`` is the share of the card that the generation engine holds (its weights,
KV cache and workspace). Everything else the process keeps on the card must fit beside it, stage by stage:

- generation: the float32 policy (not with ``param_offload``), Adam's states (not with ``optimizer_offload``), the
  other models (reference, critic, reward model) and the engine's share;
- update: policy, gradients, the activations of one micro-batch, Adam's states (with ``optimizer_offload`` only
  during the optimiser step, after the activations are gone), the other models, and the engine's share unless
  ``rollout.free_cache_engine`` releases it (weights and KV cache) for the update;
- no-grad passes (rewards, old log-probs, reference, values): policy, Adam's states (not with
  ``optimizer_offload``), the other models, the engine's share unless ``rollout.free_cache_engine`` released it, and
  the activations of one packed micro-batch; the room left sets the passes' token budget (``no_grad_tokens``, what
  models/micro_batches.py packs them to by default);
- every stage: what other processes hold on the card when the plan is made (``held_elsewhere``: another job, or a
  parent process whose caching allocator kept the blocks of a model it drew there), which the engine cannot take
  either.

The update's activations depend on how many decoder layers are checkpointed (models/checkpointed_layers.py): with
``model.gradient_checkpointing_layers=auto`` the plan checkpoints the fewest layers whose update still fits the card
with a margin (``fewest_checkpointed_layers``), which the actor then applies.

``MemoryPlan.check`` raises one ArcherError with every figure in GiB and the knobs that help. The activation
figure is an estimate (docs/memory.md gives the rule and how it was checked against the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from omegaconf import DictConfig

from archer.errors import ArcherError
from archer.models.checkpointed_layers import requested_checkpointed_layers
from archer.models.logprobs import LOGITS_BYTES_PER_CHUNK
from archer.models.micro_batches import ACTOR_UPDATE, configured_rows
from archer.models.moe import token_intermediate
from archer.models.owner import model_bytes
from archer.units import GIB

CONTEXT_BYTES = 1 * GIB  # the CUDA context, kernels' workspaces and the allocator's rounding
# Bytes an autocast (bf16) forward over float32 weights keeps per token and decoder layer for the backward:
# about 34 x hidden (residual stream, norms, q/k/v/o inputs and outputs, rope, attention) + 10 x intermediate
# (the gate/up outputs, SiLU and product). With gradient checkpointing a layer keeps only its float32 input.
PER_LAYER_HIDDEN_BYTES = 34
PER_LAYER_INTERMEDIATE_BYTES = 10
CHECKPOINTED_HIDDEN_BYTES = 4
# A no-grad forward keeps one layer's tensors at a time: per token about 24 x hidden (the float32 residual stream
# and norm, q/k/v with rope, the attention output) or 10 x hidden + 8 x intermediate (gate, up, SiLU, product),
# counted together as an upper bound.
NO_GRAD_HIDDEN_BYTES = 24
NO_GRAD_INTERMEDIATE_BYTES = 8
NO_GRAD_ROOM_SHARE = 0.8  # of the room a no-grad stage leaves, what its micro-batches may take
# gradient_checkpointing_layers=auto keeps a layer's activations only while the update's estimate, taken 1 / this
# larger, still fits the card (the estimate is already an upper bound: docs/memory.md)
UPDATE_ROOM_SHARE = 0.85
NO_GRAD_MAX_TOKENS = 65536  # beyond this a pass is no faster, only riskier
# With ppo_micro_batch_size_per_gpu unset, the update's micro-batches hold at most this many tokens (verl's
# ppo_max_token_len_per_gpu default): larger ones run no faster, and the room they would take keeps layers'
# activations instead of recomputing them (docs/memory.md)
UPDATE_MAX_TOKENS = 16384


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def activation_bytes(*, hidden: int, intermediate: int, layers: int, tokens: int, checkpointed_layers: int) -> int:
    """The update's activations for one micro-batch of ``tokens`` tokens (see the constants above): the saved
    tensors of every layer that is not checkpointed, the input of each of the ``checkpointed_layers`` plus one of
    them recomputed in the backward at a time; plus the final hidden states, their gradient and two logit chunks
    of the log-prob kernel."""
    full_layer = PER_LAYER_HIDDEN_BYTES * hidden + PER_LAYER_INTERMEDIATE_BYTES * intermediate
    recomputed = full_layer if checkpointed_layers else 0
    per_token = (checkpointed_layers * CHECKPOINTED_HIDDEN_BYTES * hidden + (layers - checkpointed_layers) * full_layer
                 + recomputed)
    return tokens * (per_token + 8 * hidden) + 2 * LOGITS_BYTES_PER_CHUNK


def no_grad_activation_bytes(*, hidden: int, intermediate: int, tokens: int) -> int:
    """A no-grad forward of one micro-batch of ``tokens`` tokens: one layer's tensors at a time (see the constants
    above) and two logit chunks of the log-prob kernel."""
    return tokens * (NO_GRAD_HIDDEN_BYTES * hidden + NO_GRAD_INTERMEDIATE_BYTES * intermediate) + 2 * LOGITS_BYTES_PER_CHUNK


def no_grad_token_budget(room: int, *, hidden: int, intermediate: int, longest: int) -> int:
    """The tokens of a no-grad micro-batch that fit NO_GRAD_ROOM_SHARE of ``room`` bytes, at most
    NO_GRAD_MAX_TOKENS and at least ``longest`` (a row longer than any budget runs alone anyway)."""
    per_token = NO_GRAD_HIDDEN_BYTES * hidden + NO_GRAD_INTERMEDIATE_BYTES * intermediate
    tokens = (int(room * NO_GRAD_ROOM_SHARE) - 2 * LOGITS_BYTES_PER_CHUNK) // per_token
    return int(max(longest, min(tokens, NO_GRAD_MAX_TOKENS)))


def micro_batch_tokens(cfg: DictConfig, max_length: int) -> int:
    """Tokens of the update's largest micro-batch: the token budget with use_dynamic_bsz (a longer row goes alone),
    else ppo_micro_batch_size_per_gpu rows (null: the whole mini-batch) of ``max_length`` tokens."""
    actor = cfg.actor
    if actor.use_dynamic_bsz:
        return max(int(actor.ppo_max_token_len_per_gpu), max_length)
    return (configured_rows(actor, ACTOR_UPDATE.size) or mini_batch_rows(cfg)) * max_length


def mini_batch_rows(cfg: DictConfig) -> int:
    """The responses of one mini-batch (ppo_mini_batch_size prompts x rollout.n)."""
    return int(cfg.actor.ppo_mini_batch_size) * int(cfg.rollout.n)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes each holder keeps on a card of ``total`` bytes (see the module docstring)."""

    total: int
    policy: int
    gradients: int
    optimizer: int
    activations: int
    engine_share: int  # utilization x total for an engine with its own weights and KV cache (0: the hf engine)
    engine_weights: int
    engine_workspace: int
    others: dict[str, int]
    kv_limit: int | None = None  # the engine allocates no more than its slots can use (max_num_seqs x max_model_len)
    utilization: float = 0.5
    param_offload: bool = False
    optimizer_offload: bool = False
    free_cache_engine: bool = True
    elsewhere: int = 0  # held on the card by other processes when the plan was made (held_elsewhere)
    model_shape: tuple[int, int] = (0, 0)  # the policy's (hidden, intermediate): no-grad activations per token
    longest: int = 0  # the longest sequence (max_model_len): no no-grad budget is below it
    checkpointed_layers: int = 0  # of the policy's decoder layers, those the update recomputes (activations counts so)
    update_rows: int | None = None  # rows per update micro-batch the plan chose (ppo_micro_batch_size_per_gpu unset)

    @property
    def kv_cache(self) -> int:
        room = self.engine_share - self.engine_weights - self.engine_workspace
        return room if self.kv_limit is None else min(room, self.kv_limit)

    @property
    def engine(self) -> int:
        """What the engine holds: its weights, workspace and KV cache (within its share)."""
        return self.engine_weights + self.engine_workspace + max(self.kv_cache, 0) if self.engine_share else 0

    def generation(self) -> dict[str, int]:
        """What the card holds while the engine generates."""
        held = {"policy": 0 if self.param_offload else self.policy,
                "optimizer states": 0 if self.optimizer_offload else self.optimizer, **self.others}
        if self.engine_share:
            held.update({"engine weights": self.engine_weights, "engine workspace": self.engine_workspace,
                         "KV cache": max(self.kv_cache, 0)})
        return {**held, **self._shared()}

    def update(self) -> dict[str, int]:
        """What the card holds at the peak of the policy update."""
        held = {"policy": self.policy, "gradients": self.gradients, **self.others}
        if self.optimizer_offload:  # states come in for the step, after the backward freed the activations
            held["activations or optimizer states"] = max(self.activations, self.optimizer)
        else:
            held.update({"optimizer states": self.optimizer, "activations": self.activations})
        if not self.free_cache_engine and self.engine_share:
            held["engine (free_cache_engine=false)"] = self.engine
        return {**held, **self._shared()}

    def no_grad_held(self) -> dict[str, int]:
        """What the card holds during the no-grad passes, besides their activations."""
        held = {"policy": self.policy, "optimizer states": 0 if self.optimizer_offload else self.optimizer,
                **self.others}
        if not self.free_cache_engine and self.engine_share:
            held["engine (free_cache_engine=false)"] = self.engine
        return {**held, **self._shared()}

    def no_grad_room(self) -> int:
        """Bytes the no-grad passes' activations may take."""
        return max(0, self.total - sum(self.no_grad_held().values()))

    def no_grad_tokens(self, hidden: int | None = None, intermediate: int | None = None) -> int:
        """The token budget of a no-grad pass of a model of this (hidden, intermediate) shape (default: the
        policy's, which the reference and the critic share)."""
        default_hidden, default_intermediate = self.model_shape
        return no_grad_token_budget(self.no_grad_room(), hidden=hidden or default_hidden,
                                    intermediate=intermediate or default_intermediate, longest=self.longest)

    def no_grad(self) -> dict[str, int]:
        """What the card holds at the peak of a no-grad pass of the policy's shape at its token budget."""
        hidden, intermediate = self.model_shape
        activations = no_grad_activation_bytes(hidden=hidden, intermediate=intermediate, tokens=self.no_grad_tokens())
        return {**self.no_grad_held(), "no-grad activations": activations}

    def _shared(self) -> dict[str, int]:
        """What every stage has beside this process's tensors: its CUDA context, and other processes' memory."""
        return {"CUDA context": CONTEXT_BYTES, "other processes": self.elsewhere}

    def check(self) -> None:
        """One ArcherError naming the stage that does not fit, its figures and the knobs that help."""
        if self.engine_share and self.kv_cache < 0:
            raise ArcherError(
                f"rollout.gpu_memory_utilization={self.utilization} leaves no room for the fast engine's KV cache: "
                f"of the card's {gib(self.total)} GiB it may hold {gib(self.engine_share)} GiB, its weights take "
                f"{gib(self.engine_weights)} GiB and its workspace {gib(self.engine_workspace)} GiB",
                "raise actor_rollout_ref.rollout.gpu_memory_utilization, or lower rollout.max_num_seqs / "
                "rollout.max_num_batched_tokens")
        stages = (("generation", self.generation()), ("the no-grad passes", self.no_grad()),
                  ("the policy update", self.update()))
        for stage, held in stages:
            need = sum(held.values())
            if need > self.total:
                figures = ", ".join(f"{name} {gib(value)}" for name, value in held.items() if value)
                raise ArcherError(
                    f"the GPU's {gib(self.total)} GiB cannot hold {stage}: it needs {gib(need)} GiB ({figures}; "
                    "GiB)", self.knobs(stage))

    def knobs(self, stage: str) -> str:
        """The settings that lower ``stage``'s figures, largest saving first."""
        prefix = "actor_rollout_ref."
        options: list[tuple[int, str]] = []
        if not self.optimizer_offload:
            options.append((self.optimizer, f"{prefix}actor.fsdp_config.optimizer_offload=true"))
        if stage == "generation":
            options.append((max(self.kv_cache, 0),
                            f"a lower {prefix}rollout.gpu_memory_utilization (now {self.utilization})"))
            if not self.param_offload:
                options.append((self.policy, f"{prefix}actor.fsdp_config.param_offload=true"))
        else:
            if stage == "the policy update":
                options.append((self.activations, f"{prefix}model.enable_gradient_checkpointing=true (with "
                                                  f"{prefix}model.gradient_checkpointing_layers auto or all) and a smaller "
                                                  f"{prefix}actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz "
                                                  "with a smaller ppo_max_token_len_per_gpu)"))
            if not self.free_cache_engine and self.engine_share:
                options.append((self.engine, f"{prefix}rollout.free_cache_engine=true"))
        options.append((self.policy, f"LoRA ({prefix}model.lora_rank > 0) or a smaller model"))
        if self.elsewhere:
            options.append((self.elsewhere, f"a GPU that other processes do not use (they hold {gib(self.elsewhere)} "
                                            "GiB of it: nvidia-smi lists them)"))
        return "try " + "; or ".join(text for _, text in sorted(options, key=lambda o: -o[0]))


def planned_no_grad_tokens(plan: MemoryPlan | None, model: torch.nn.Module) -> int | None:
    """The token budget the memory plan gives a no-grad pass of ``model`` (None without a plan: on a CPU)."""
    if plan is None:
        return None
    config = model.config
    has_width = getattr(config, "intermediate_size", None) is not None
    return plan.no_grad_tokens(getattr(config, "hidden_size", None), token_intermediate(config) if has_width else None)


def held_elsewhere(*, total: int, free: int, reserved: int) -> int:
    """Bytes of a card of ``total`` bytes, ``free`` of them free, that neither this process's caching allocator
    (``reserved``, after its free blocks were given back) nor its CUDA context (CONTEXT_BYTES) holds: other
    processes' memory."""
    return max(0, total - free - reserved - CONTEXT_BYTES)


def card_figures(device: torch.device) -> tuple[int, int]:
    """(the card's total bytes, bytes other processes hold on it: held_elsewhere) once this process's cached
    blocks are given back."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, held_elsewhere(total=total, free=free, reserved=torch.cuda.memory_reserved(device))


def plan_actor_memory(cfg: DictConfig, model: torch.nn.Module, *, total: int, fast_engine: bool,
                      others: dict[str, int] | None = None, elsewhere: int = 0, shards: int = 1) -> MemoryPlan:
    """The plan of a card holding an actor (``actor_rollout_ref`` config ``cfg``) whose policy is ``model``, on a
    card of ``total`` bytes of which other processes hold ``elsewhere``; ``fast_engine``: the engine holds its own
    weights and KV cache (rollout.gpu_memory_utilization); ``others``: the bytes each other model keeps on this
    card (the colocated workers' ``ModelOwner.card_bytes``; a reward model whole); ``shards``: the ranks FSDP2
    shards the policy over (each card holds 1/shards of the policy, its gradients and its optimiser state; the
    engine's copy and the activations are whole)."""
    from archer.rollout.fast.engine import PAGE_SIZE, workspace_bytes
    from archer.rollout.fast.model import model_spec, weight_bytes
    from archer.rollout.fast.pages import page_bytes

    policy, trainable = (-(-size // shards) for size in model_bytes(model))
    config = model.config
    rollout = cfg.rollout
    max_length = int(rollout.max_model_len or int(rollout.prompt_length) + int(rollout.response_length))
    layers = int(config.num_hidden_layers)
    shape = {"hidden": int(config.hidden_size), "intermediate": token_intermediate(config), "layers": layers,
             "tokens": micro_batch_tokens(cfg, max_length)}
    requested = requested_checkpointed_layers(cfg.model, layers)
    checkpointed = layers if requested is None else requested
    utilization = float(rollout.gpu_memory_utilization)
    share = weights = workspace = 0
    kv_limit = None
    if fast_engine:
        spec, dtype = model_spec(model), getattr(torch, str(rollout.dtype))
        share = int(utilization * total)
        weights = weight_bytes(spec, dtype)
        workspace = workspace_bytes(spec, dtype, int(rollout.max_num_seqs), int(rollout.max_num_batched_tokens))
        pages = (int(rollout.max_num_seqs) + 1) * -(-max_length // PAGE_SIZE) + 1  # FastEngine.reclaim_memory's cap
        kv_limit = pages * page_bytes(spec, PAGE_SIZE, dtype)
    offload = cfg.actor.fsdp_config
    plan = MemoryPlan(total=total, policy=policy, gradients=4 * trainable, optimizer=8 * trainable,
                      activations=activation_bytes(**shape, checkpointed_layers=checkpointed), engine_share=share,
                      engine_weights=weights, engine_workspace=workspace, others=dict(others or {}),
                      kv_limit=kv_limit, utilization=utilization,
                      param_offload=bool(offload.param_offload),
                      optimizer_offload=bool(offload.optimizer_offload),
                      free_cache_engine=bool(rollout.free_cache_engine), elsewhere=elsewhere,
                      model_shape=(shape["hidden"], shape["intermediate"]), longest=max_length,
                      checkpointed_layers=checkpointed)
    if not cfg.actor.use_dynamic_bsz and configured_rows(cfg.actor, ACTOR_UPDATE.size) is None:
        return largest_fitting_rows(plan, shape, requested, max_length, mini_batch_rows(cfg))
    return plan if requested is not None else fewest_checkpointed_layers(plan, shape)


def largest_fitting_rows(plan: MemoryPlan, shape: dict[str, int], requested: int | None, max_length: int,
                         mini_rows: int) -> MemoryPlan:
    """ppo_micro_batch_size_per_gpu unset: ``plan`` with the most rows per update micro-batch (of ``max_length``
    tokens each, at most ``mini_rows`` and UPDATE_MAX_TOKENS) whose update fits the card with the activations'
    margin, its checkpointed layers chosen for them (``requested``, or with ``auto`` the fewest that fit); one
    row when none fits (``check`` then says whether even that does)."""
    for rows in range(max(1, min(mini_rows, UPDATE_MAX_TOKENS // max_length)), 0, -1):
        sized = {**shape, "tokens": rows * max_length}
        layers = shape["layers"] if requested is None else requested
        candidate = replace(plan, activations=activation_bytes(**sized, checkpointed_layers=layers),
                            checkpointed_layers=layers, update_rows=rows)
        if requested is None:
            candidate = fewest_checkpointed_layers(candidate, sized)
        if rows == 1 or update_fits_with_margin(candidate):
            return candidate
    raise AssertionError("unreachable: one row is always returned")


def fewest_checkpointed_layers(plan: MemoryPlan, shape: dict[str, int]) -> MemoryPlan:
    """gradient_checkpointing_layers=auto: ``plan`` with the fewest checkpointed layers (of a model of ``shape``,
    activation_bytes' keywords) whose update fits the card with the activations taken 1 / UPDATE_ROOM_SHARE larger;
    every layer when no fewer fit so (then ``check`` says whether even that fits)."""
    for count in range(shape["layers"] + 1):
        candidate = replace(plan, activations=activation_bytes(**shape, checkpointed_layers=count),
                            checkpointed_layers=count)
        if update_fits_with_margin(candidate):
            return candidate
    return plan


def update_fits_with_margin(plan: MemoryPlan) -> bool:
    """Whether the update fits the card with its activation estimate taken 1 / UPDATE_ROOM_SHARE larger."""
    with_margin = replace(plan, activations=int(plan.activations / UPDATE_ROOM_SHARE))
    return sum(with_margin.update().values()) <= plan.total


def release_cached_blocks(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the card (what the last stage freed but still cached)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
