"""The SFT loop (``archer sft``): warm-start a causal LM on prompt/response data with cross-entropy over the
response tokens only, and write the run directory (config, metrics, plots, summary, HF model folder).

The loss of a step is the mean negative log-likelihood over all response tokens of the whole training
batch, accumulated over micro-batches, so any micro-batch size gives the same gradient. Log-probs come
from the backbone's hidden states at response positions only, in chunks (never full [tokens x vocab]).
With ``model.lora_rank > 0`` only LoRA adapters on the frozen base are trained (models/lora.py); hf_model is
then the merged model and hf_model/lora_adapter the adapters. With ``data.packing`` each forward pass is one row
of whole examples kept apart by their position ids (``pack_sft``): the same loss, no padding.

Checkpoints (``trainer.save_freq``) go through the RL trainer's CheckpointManager: ``global_step_N/model`` (the
policy as ``ModelOwner.save`` writes it, with optimiser and scheduler state) and ``trainer_state.pt`` (step, data
position, RNG states, the last metrics and wall time); ``trainer.resume_mode`` picks the one a run continues from,
exactly. The run folder's guard and resume recipe are the RL trainer's (trainer/run_folder.py): another
experiment's folder is refused, and a finished run's rerun changes nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    set_seed,
)

from archer.atomic_files import recorded_path, write_json_atomically
from archer.batch import Batch
from archer.config.loader import as_list, save_config
from archer.data.loader import PromptLoader
from archer.data.sft_dataset import SFTDataset, pack_sft, read_sft_conversations, token_slots
from archer.data.sft_formats import FORMATS, nearest_format
from archer.errors import ArcherError
from archer.folder_lock import hold_folder, refuse_if_held
from archer.models.loading import (
    autocast_for,
    load_tokenizer,
    pick_device,
)
from archer.models.logprobs import logit_softcap, logprobs_from_hidden, masked_hidden, masked_logprobs
from archer.models.lora import LoraSettings
from archer.models.optim import SFT_SCHEDULERS, LRSchedule, clip_and_step
from archer.models.owner import ModelOwner
from archer.models.sequence_layout import predicted_targets
from archer.trainer.checkpoint_dirs import CheckpointManager
from archer.trainer.plots import plot_metrics
from archer.trainer.run_folder import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    SUMMARY_FILE,
    RunClock,
    RunFolder,
    check_resume_mode,
    checkpoint_to_resume,
    restore_trainer_state,
    save_trainer_state,
)
from archer.trainer.tracking import METRICS_FILE, Tracking

MODEL_DIR = "model"  # a checkpoint's HF model folder (with its optimiser state)
CHUNK_SIZE = 1024  # response tokens per chunk of the lm_head + log-softmax
logger = logging.getLogger("archer.sft")
KEY_METRICS = ("train/loss", "val/loss", "train/lr")
PLOT_GROUPS = {"loss": ["train/loss", "val/loss"], "token_acc": ["val/token_acc"], "lr": ["train/lr"],
               "grad_norm": ["train/grad_norm"]}


def run_sft(cfg: DictConfig) -> Path:
    """Train as ``cfg`` (archer/config/sft_trainer.yaml) says; return ``<default_local_dir>/hf_model``."""
    check_sft_config(cfg)
    run_dir = Path(cfg.trainer.default_local_dir)
    checkpoints = CheckpointManager(run_dir / CHECKPOINTS_DIR, cfg.trainer.max_ckpt_to_keep)
    folder = RunFolder(cfg, "sft_trainer")
    refuse_if_held(run_dir, "archer sft")  # a folder another process writes, then another experiment's, refused
    folder.check_experiment()  # before any data or model loads
    clock = RunClock()
    set_seed(cfg.trainer.seed)
    device = pick_device(cfg.trainer.device)
    tokenizer = load_tokenizer(cfg.model.partial_pretrain)
    train_set = build_dataset(cfg, tokenizer, cfg.data.train_files)
    val_set = build_dataset(cfg, tokenizer, cfg.data.val_files) if as_list(cfg.data.val_files) else None
    loader = _train_loader(train_set, cfg)
    total_steps = cfg.trainer.total_training_steps or loader.steps_per_epoch * cfg.trainer.total_epochs
    model_dir = run_dir / "hf_model"
    if folder.finished_summary(total_steps) is not None:
        return model_dir
    with hold_folder(run_dir, "archer sft"):  # one process writes a run folder, from here until it ends
        owner = ModelOwner.policy(cfg.model.partial_pretrain, device=device,
                                  lora=LoraSettings.from_config(cfg.model, prefix="model"),
                                  gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                                  trust_remote_code=cfg.model.trust_remote_code,
                                  liger_key="model.use_liger" if cfg.model.use_liger else None)
        owner.attach_optimizer(cfg.optim, LRSchedule.from_sft_optim(cfg.optim, total_steps))
        save_config(cfg, run_dir / CONFIG_FILE)
        last = _train(owner, tokenizer, loader, val_set, cfg, total_steps, checkpoints, clock)
        owner.save_model(model_dir, tokenizer)
        if cfg.trainer.plots:
            plot_metrics(run_dir / METRICS_FILE, run_dir / "plots", PLOT_GROUPS)
        _write_summary(run_dir, last, total_steps, clock.seconds(), model_dir)
        return model_dir


def _train(owner: ModelOwner, tokenizer: PreTrainedTokenizerBase, loader: PromptLoader, val_set: SFTDataset | None,
           cfg: DictConfig, total_steps: int, checkpoints: CheckpointManager, clock: RunClock) -> dict[str, float]:
    """The optimisation loop with its metrics and checkpoints (resumed from one when trainer.resume_mode says
    so); returns the latest value of every metric (those of the steps before a resume included)."""
    model, device = owner.model, owner.device
    start, last = _resume(cfg.trainer, checkpoints, owner, loader, clock)
    with Tracking(Path(cfg.trainer.default_local_dir), backends=as_list(cfg.trainer.logger), project=cfg.trainer.project_name,
                  experiment=cfg.trainer.experiment_name, config=OmegaConf.to_container(cfg, resolve=True),
                  total_steps=total_steps, key_metrics=KEY_METRICS, start_step=start) as tracking:
        for step in range(start + 1, total_steps + 1):
            items, micro = loader.next_batch(), cfg.data.micro_batch_size_per_gpu
            if cfg.data.packing:  # one packed row a forward pass, as many tokens as an unpacked micro-batch at most
                batch = pack_sft(items, loader.dataset.pad_token_id, micro * cfg.data.max_length,
                                 unpacked_micro_batch_size=micro)
                micro = 1
            else:
                batch = loader.dataset.collate(items)
            # the batch stays on the host: each micro-batch is laid out there and moved without the host waiting
            metrics = train_step(model, owner.optimizer, owner.scheduler, batch, micro_batch_size=micro,
                                 clip_grad=cfg.optim.clip_grad)
            epoch_end = loader.position == 0
            if val_set is not None and _should_validate(step, epoch_end, total_steps, cfg.trainer.test_freq):
                metrics |= evaluate(model, val_set, cfg.data.micro_batch_size_per_gpu, device)
            # logged before the checkpoint commits: a run killed in between redoes this step from the previous one
            tracking.log(metrics, step=step)
            last |= metrics
            if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == total_steps):
                _save_checkpoint(checkpoints, step, owner, tokenizer, loader, clock, last)
    return last


def _save_checkpoint(checkpoints: CheckpointManager, step: int, owner: ModelOwner, tokenizer: PreTrainedTokenizerBase,
                     loader: PromptLoader, clock: RunClock, last: dict[str, float]) -> Path:
    """``<run>/checkpoints/global_step_N``: the model as an HF folder with its optimiser and scheduler state, and
    the step, data position, RNG states, last metrics and wall time; written atomically, older ones pruned to
    trainer.max_ckpt_to_keep."""
    def write(tmp: Path) -> None:
        owner.save(tmp / MODEL_DIR, tokenizer)
        save_trainer_state(tmp, step, loader, clock, {"last": last})

    return checkpoints.save(step, write)


def _resume(trainer: DictConfig, checkpoints: CheckpointManager, owner: ModelOwner, loader: PromptLoader,
            clock: RunClock) -> tuple[int, dict[str, float]]:
    """Restore the checkpoint trainer.resume_mode names (auto: the newest of the run, if any; resume_path:
    trainer.resume_from_path; disable: none); returns the step to continue from and the last metrics so far."""
    path = checkpoint_to_resume(trainer, checkpoints, MODEL_DIR)
    if path is None:
        return 0, {}
    owner.load(path / MODEL_DIR, "model")
    state = restore_trainer_state(path, loader, clock)
    return int(state["global_step"]), dict(state["run"].get("last", {}))


def check_sft_config(cfg: DictConfig) -> None:
    """Values of an SFT config that cannot train, reported before any data or model loads."""
    LoraSettings.from_config(cfg.model, prefix="model")  # lora_rank, lora_alpha, target_modules
    checks = [
        (cfg.data.train_batch_size > 0, "data.train_batch_size must be positive", "e.g. data.train_batch_size=32"),
        (cfg.data.micro_batch_size_per_gpu > 0, "data.micro_batch_size_per_gpu must be positive",
         "e.g. data.micro_batch_size_per_gpu=4"),
        (cfg.trainer.total_epochs > 0 or cfg.trainer.total_training_steps,
         "trainer.total_epochs must be positive unless trainer.total_training_steps is set",
         "e.g. trainer.total_epochs=1"),
        (cfg.trainer.total_training_steps is None or cfg.trainer.total_training_steps > 0,
         "trainer.total_training_steps must be positive or null", "e.g. trainer.total_training_steps=100"),
        (cfg.optim.lr_scheduler in SFT_SCHEDULERS, f"optim.lr_scheduler={cfg.optim.lr_scheduler!r} is not known",
         f"use one of {list(SFT_SCHEDULERS)}"),
        (0.0 <= cfg.optim.warmup_steps_ratio <= 1.0, "optim.warmup_steps_ratio must be within [0, 1]",
         "e.g. optim.warmup_steps_ratio=0.1"),
        (cfg.optim.clip_grad > 0, "optim.clip_grad must be positive", "e.g. optim.clip_grad=1.0"),
        (cfg.data.format in FORMATS, f"data.format={cfg.data.format!r} is not an SFT data format",
         f"{nearest_format(str(cfg.data.format))}use one of {list(FORMATS)}"),
    ]
    for ok, problem, fix in checks:
        if not ok:
            raise ArcherError(problem, fix)
    check_resume_mode(cfg.trainer)


def build_dataset(cfg: DictConfig, tokenizer: PreTrainedTokenizerBase, files: Any) -> SFTDataset:
    """An SFTDataset over ``files`` (paths, or dataset names of data.dataset_info) with the data.* settings of ``cfg``."""
    data = cfg.data
    conversations, where = read_sft_conversations(
        files, dataset_info=data.dataset_info, data_format=data.format, prompt_key=data.prompt_key,
        response_key=data.response_key, multiturn=data.multiturn.enable, messages_key=data.multiturn.messages_key,
        tools_key=data.multiturn.tools_key)
    return SFTDataset(conversations, tokenizer, max_length=data.max_length, truncation=data.truncation,
                      tool_result_tag=data.tool_result_tag, where=where)


def _train_loader(dataset: SFTDataset, cfg: DictConfig) -> PromptLoader:
    """Batches of data.train_batch_size examples in a seeded order per epoch, resumable from its state_dict."""
    if len(dataset) < cfg.data.train_batch_size:
        raise ArcherError(f"the training data has {len(dataset)} examples, fewer than one batch "
                          f"(data.train_batch_size={cfg.data.train_batch_size})",
                          f"set data.train_batch_size to at most {len(dataset)}, or add examples")
    n, seed = len(dataset), int(cfg.trainer.seed)
    return PromptLoader(dataset, cfg.data.train_batch_size, shuffle=True, seed=seed, drop_last=True,
                        order=lambda epoch: torch_dataloader_order(n, seed, epoch))


def torch_dataloader_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which ``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))`` visits ``n``
    examples in ``epoch`` (counting from 0), as archer's SFT drew it before its loader became resumable: the same
    seed still gives the same warm start (the quickstarts' recorded figures). Each epoch of that DataLoader draws
    its iterator's base seed, the permutation, and one more permutation for the (empty) remainder."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epoch + 1):
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = torch.randperm(n, generator=generator)
        torch.randperm(n, generator=generator)
    return order.numpy()


def _should_validate(step: int, epoch_end: bool, total_steps: int, test_freq: int) -> bool:
    return epoch_end or step == total_steps or (test_freq > 0 and step % test_freq == 0)


def response_hidden(model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_hidden`` of an SFT batch: the hidden states that predict its loss_mask tokens, and those tokens."""
    return masked_hidden(model, *_model_inputs(batch), packed=bool(batch.info.get("packed")))


def response_logprobs(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """``masked_logprobs`` of an SFT batch: log-probs (float32, [N]) of its N tokens with loss_mask 1."""
    return masked_logprobs(model, *_model_inputs(batch), packed=bool(batch.info.get("packed")), chunk_size=CHUNK_SIZE)


def _model_inputs(batch: Batch) -> tuple[torch.Tensor, ...]:
    return tuple(batch[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask"))


def sft_backward(model: PreTrainedModel, batch: Batch, micro_batch_size: int) -> tuple[float, int]:
    """Accumulate into ``.grad`` the gradient of the batch's mean response-token NLL, one micro-batch at a
    time, each normalised by the whole batch's token count. Returns (loss, number of response tokens). The batch
    is best on the host: its count and each micro-batch's layout are worked out there (docs/architecture.md, "The
    host never waits inside a pass"), and the losses read back once."""
    num_tokens = int(predicted_targets(batch["loss_mask"], batch["position_ids"],
                                       packed=bool(batch.info.get("packed"))).sum())
    losses = []
    for micro in batch.split(micro_batch_size):
        loss = -response_logprobs(model, micro).sum() / max(num_tokens, 1)
        loss.backward()
        losses.append(loss.detach())
    return sum(torch.stack(losses).double().tolist()), num_tokens  # read back once, summed as before


def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, scheduler: LambdaLR, batch: Batch, *,
               micro_batch_size: int, clip_grad: float) -> dict[str, float]:
    """One optimizer step on ``batch``; a step whose gradient norm is not finite is skipped. ``train/token_slots``:
    the token positions the forward passes computed (real and padding); for packed rows also what the same
    examples unpacked would have cost (``train/token_slots_unpacked``)."""
    optimizer.zero_grad(set_to_none=True)
    loss, num_tokens = sft_backward(model, batch, micro_batch_size)
    lr = scheduler.get_last_lr()[0]
    grad_norm, _ = clip_and_step(model, optimizer, clip_grad)
    scheduler.step()
    metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/num_tokens": float(num_tokens),
               "train/token_slots": float(token_slots(batch["attention_mask"].sum(dim=1).tolist(), micro_batch_size))}
    if batch.info.get("packed"):
        metrics["train/token_slots_unpacked"] = float(batch.info["token_slots_unpacked"])
    return metrics


@torch.no_grad()
def evaluate(model: PreTrainedModel, dataset: SFTDataset, batch_size: int, device: torch.device) -> dict[str, float]:
    """val/loss (mean NLL over all response tokens) and val/token_acc (share of response tokens that are
    the model's greedy prediction)."""
    model.eval()
    lm_head = model.get_output_embeddings()
    count = 0
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # NLL and greedy hits, read back at the end
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=dataset.collate):
        with autocast_for(device):
            hidden, labels = response_hidden(model, batch)
            sums[0] -= logprobs_from_hidden(hidden, lm_head, labels, chunk_size=CHUNK_SIZE, compute_entropy=False,
                                            softcap=logit_softcap(model))[0].sum().double()
            for h, y in zip(hidden.split(CHUNK_SIZE), labels.split(CHUNK_SIZE), strict=True):
                sums[1] += (lm_head(h).argmax(dim=-1) == y).sum()
        count += len(labels)
    model.train()
    nll, hits = sums.tolist()
    return {"val/loss": nll / max(count, 1), "val/token_acc": hits / max(count, 1)}


def _write_summary(run_dir: Path, last: dict[str, float], steps: int, wall_time_s: float, model_dir: Path) -> None:
    summary = {
        "final_train_loss": last.get("train/loss"),
        "final_val_loss": last.get("val/loss"),
        "final_val_token_acc": last.get("val/token_acc"),
        "steps": steps,
        "wall_time_s": round(wall_time_s, 3),
        "model_path": recorded_path(model_dir),
        **_token_slot_totals(run_dir / METRICS_FILE),
    }
    write_json_atomically(run_dir / SUMMARY_FILE, summary)


def _token_slot_totals(metrics_file: Path) -> dict[str, float]:
    """The run's token positions computed (from every logged step, so a resumed run counts its first part too)
    and, with packing, what unpacked rows would have cost and the share packing saved."""
    lines = [json.loads(line) for line in metrics_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    totals = {"token_slots": sum(m.get("train/token_slots") or 0 for m in lines)}
    unpacked = sum(m.get("train/token_slots_unpacked") or 0 for m in lines)
    if unpacked:
        totals |= {"token_slots_unpacked": unpacked, "packing_token_saving": round(1 - totals["token_slots"] / unpacked, 4)}
        logger.info("packing: %d token positions instead of %d unpacked (%.1f%% saved)", totals["token_slots"],
                    unpacked, 100 * totals["packing_token_saving"])
    return totals
