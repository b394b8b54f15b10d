"""The enumerated values and numeric ranges of an RL config that no other check covers, checked by
``check_config`` before any data, model or folder is touched.

Each enumerated key is checked against the names of what implements it (the registries of estimators, losses,
aggregation modes and KL estimators, the KL controllers, the optimiser's schedules, the truncation modes, the
dtypes), never a list of its own; learning rates must be positive, fractions within [0, 1], and the batch sizes
nested as verl checks them: a micro-batch no larger than its mini-batch (``ppo_mini_batch_size x rollout.n``
responses shared by the ranks). The keys other checks cover (the policy loss, the engine, the reward manager,
the trainer and resume modes, rollout correction, ``trainer.health``) are checked where they are implemented.
"""

from __future__ import annotations

from collections.abc import Collection

from omegaconf import DictConfig, OmegaConf

from archer.algorithms.advantages import ADV_ESTIMATORS
from archer.algorithms.aggregation import AGG_MODES
from archer.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
from archer.config.world import world_size
from archer.data.rl_dataset import TRUNCATION_MODES
from archer.errors import ArcherError
from archer.models.loading import DTYPE_NAMES, check_device_name
from archer.models.optim import WARMUP_STYLES
from archer.trainer.tracking import check_backends

ACTOR, CRITIC, ROLLOUT = "actor_rollout_ref.actor", "critic", "actor_rollout_ref.rollout"
FSDP = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.model.fsdp_config")

CHOICES: tuple[tuple[str, Collection[str]], ...] = (
    ("algorithm.adv_estimator", ADV_ESTIMATORS),
    ("algorithm.kl_penalty", KL_ESTIMATORS),
    ("algorithm.kl_ctrl.type", KL_CONTROLLERS),
    (f"{ACTOR}.kl_loss_type", KL_ESTIMATORS),
    (f"{ACTOR}.loss_agg_mode", AGG_MODES),
    (f"{CRITIC}.loss_agg_mode", AGG_MODES),
    (f"{ACTOR}.optim.warmup_style", WARMUP_STYLES),
    (f"{CRITIC}.optim.warmup_style", WARMUP_STYLES),
    ("data.truncation", TRUNCATION_MODES),
    ("reward_model.truncation", TRUNCATION_MODES),  # the reward model's inputs cut as the prompts are
    (f"{FSDP[0]}.model_dtype", DTYPE_NAMES),
    (f"{FSDP[2]}.model_dtype", DTYPE_NAMES),
    *((f"{section}.mixed_precision.{key}", DTYPE_NAMES) for section in FSDP for key in ("param_dtype", "reduce_dtype")),
)
TORCH_DTYPES = ("bfloat16", "float16", "float32")  # rollout.dtype: a torch dtype's name (torch.<name>)

POSITIVE = (f"{ACTOR}.optim.lr", f"{CRITIC}.optim.lr")
# Fractions; the keys after the first group may also be null (their loss's or the schedule's default).
FRACTIONS = (
    f"{ACTOR}.optim.lr_warmup_steps_ratio", f"{CRITIC}.optim.lr_warmup_steps_ratio", f"{ACTOR}.token_entropy_quantile",
    f"{ROLLOUT}.top_p", f"{ROLLOUT}.val_kwargs.top_p", f"{ROLLOUT}.gpu_memory_utilization",
)
# min_lr_ratio null is verl's "no floor" (ARPO's published config sets the critic's so): the schedule reads it as 0.
NULLABLE_FRACTIONS = (f"{ACTOR}.optim.min_lr_ratio", f"{CRITIC}.optim.min_lr_ratio", f"{ACTOR}.entropy_top_ratio",
                      f"{ACTOR}.policy_loss.clip_cov_ratio", f"{ACTOR}.policy_loss.kl_cov_ratio")
NON_NEGATIVE = (f"{ACTOR}.clip_ratio", f"{ACTOR}.kl_loss_coef", "algorithm.kl_ctrl.kl_coef", f"{ROLLOUT}.temperature",
                f"{ROLLOUT}.val_kwargs.temperature")
NULLABLE_NON_NEGATIVE = (f"{ACTOR}.clip_ratio_low", f"{ACTOR}.clip_ratio_high")


def check_choice(key: str, value: object, allowed: Collection[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ArcherError(f"unknown {key} {value!r}", f"set {key} to one of: {', '.join(sorted(allowed))}")


def check_choices(cfg: DictConfig) -> None:
    """Every enumerated key of CHOICES names one of its implementations; rollout.dtype, trainer.device and
    trainer.logger too."""
    for key, allowed in CHOICES:
        check_choice(key, OmegaConf.select(cfg, key), allowed)
    check_choice(f"{ROLLOUT}.dtype", OmegaConf.select(cfg, f"{ROLLOUT}.dtype"), TORCH_DTYPES)
    check_device_name(str(cfg.trainer.device))
    check_backends(OmegaConf.to_container(cfg.trainer.logger) if OmegaConf.is_list(cfg.trainer.logger)
                   else cfg.trainer.logger)


def _number(cfg: DictConfig, key: str, nullable: bool) -> float | None:
    value = OmegaConf.select(cfg, key)
    if value is None and nullable:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ArcherError(f"{key}={value!r} is not a number", f"set {key} to a number")
    return float(value)


def check_ranges(cfg: DictConfig) -> None:
    """Learning rates > 0, fractions in [0, 1], coefficients and temperatures >= 0."""
    for key in POSITIVE:
        value = _number(cfg, key, False)
        if not value > 0:
            raise ArcherError(f"{key}={value:g} must be positive", f"set {key} to a learning rate above 0, e.g. 1e-6")
    for keys, nullable in ((FRACTIONS, False), (NULLABLE_FRACTIONS, True)):
        for key in keys:
            value = _number(cfg, key, nullable)
            if value is not None and not 0 <= value <= 1:
                raise ArcherError(f"{key}={value:g} is not a fraction in [0, 1]", f"set {key} between 0 and 1")
    for keys, nullable in ((NON_NEGATIVE, False), (NULLABLE_NON_NEGATIVE, True)):
        for key in keys:
            value = _number(cfg, key, nullable)
            if value is not None and value < 0:
                raise ArcherError(f"{key}={value:g} is negative", f"set {key} to 0 or more")


def check_micro_batches(cfg: DictConfig) -> None:
    """As verl: a micro-batch holds at most the responses of its rank's share of a mini-batch
    (ppo_mini_batch_size prompts x rollout.n, over the ranks), for the actor and (with GAE) the critic, unless
    micro-batches are sized by tokens (use_dynamic_bsz)."""
    n, world = int(cfg.actor_rollout_ref.rollout.n), world_size(cfg.trainer)
    sections = [ACTOR] + ([CRITIC] if cfg.algorithm.adv_estimator == "gae" else [])
    for section in sections:
        node = OmegaConf.select(cfg, section)
        if node.use_dynamic_bsz:
            continue
        mini = int(node.ppo_mini_batch_size) * n // world
        for key, micro in (("ppo_micro_batch_size_per_gpu", node.ppo_micro_batch_size_per_gpu),
                           ("ppo_micro_batch_size", None if node.ppo_micro_batch_size is None
                            else int(node.ppo_micro_batch_size) // world)):
            if micro is not None and int(micro) > mini:
                raise ArcherError(
                    f"{section}.{key}={OmegaConf.select(node, key)} is larger than a mini-batch: "
                    f"{section}.ppo_mini_batch_size={node.ppo_mini_batch_size} prompts x rollout.n={n} over "
                    f"{world} rank(s) is {mini} responses per rank",
                    f"set {section}.{key} to at most {mini} (or null: the whole mini-batch)")
