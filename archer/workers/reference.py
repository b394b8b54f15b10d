"""The reference worker: a frozen copy of the initial policy that scores responses for KL."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.models.loading import default_dtype, load_causal_lm
from archer.workers.actor import compute_log_probs
from archer.workers.micro_batches import MicroBatching


class ReferenceWorker:
    """Holds the frozen reference model (bf16 on GPU) and computes ``ref_log_prob``."""

    def __init__(self, cfg: DictConfig, *, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.model = load_causal_lm(cfg.model.path, device=device, dtype=default_dtype(device),
                                    trust_remote_code=bool(cfg.model.trust_remote_code))
        self.model.eval().requires_grad_(False)
        self.temperature = float(cfg.rollout.temperature)
        self.micro = MicroBatching.from_config(
            cfg.ref, size_key="log_prob_micro_batch_size", dynamic_key="log_prob_use_dynamic_bsz",
            budget_key="log_prob_max_token_len_per_gpu", remove_padding=bool(cfg.model.use_remove_padding))

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        logp, _ = compute_log_probs(self.model, batch, temperature=self.temperature, micro=self.micro,
                                    chunk_size=self.cfg.actor.logprob_chunk_size, device=self.device,
                                    compute_entropy=False)
        return Batch({"ref_log_prob": logp})
