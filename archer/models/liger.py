"""liger-kernel's fused Triton kernels in a policy's decoder layers (verl's ``model.use_liger``).

With ``use_liger=true`` a model loaded on a GPU runs liger's RMSNorm, SwiGLU MLP and rotary embedding in place of
transformers' eager ops (one kernel each instead of several elementwise ones); its matrix products, attention and
archer's chunked log-prob kernel are unchanged. Measured on an H100 at Qwen2.5-1.5B's shape (BENCHMARKS.md,
"Per-stage MFU"): the packed update and the no-grad log-prob pass take about a fifth less time.

What to know:
- liger patches transformers' module of the architecture (e.g. ``modeling_qwen2``) for the whole process, besides
  the model's own layers: every model of that architecture the process builds afterwards (the reference, a critic)
  runs the same kernels, and the rotary embedding is replaced for models built before too;
- the kernels compute in the same precision as transformers' (RMSNorm in float32), so log-probs agree with the
  eager ops to bf16 rounding (tests/test_liger_gpu.py), not bit for bit;
- they are Triton kernels: on the CPU the key has no effect (one warning); an architecture liger does not cover
  keeps its eager ops (one warning). liger-kernel is an optional dependency (``pip install liger-kernel``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from archer.errors import ArcherError

log = logging.getLogger("archer.models")

RL_KEY = "actor_rollout_ref.model.use_liger"  # the RL config's key (the policy and its reference)
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True,
                 # archer's chunked kernel makes the log-probs; liger's loss kernels would never run
                 "cross_entropy": False, "fused_linear_cross_entropy": False}


def apply_liger(model: nn.Module, device: torch.device, key: str) -> bool:
    """Swap ``model``'s RMSNorm, SwiGLU MLP and rotary embedding for liger's kernels when ``device`` is a GPU;
    returns whether it did. ``key``: the config key that asked (named in the messages)."""
    if device.type != "cuda":
        log.warning("%s=true has no effect on %s: liger's kernels are Triton kernels for GPUs", key, device.type)
        return False
    registry = logging.getLogger("liger_kernel.backends.registry")
    if registry.level == logging.NOTSET:  # it warns, at a kernel's first call, of every optional backend it lacks
        registry.setLevel(logging.ERROR)  # (CuTe DSL, Ascend), which nobody running on an NVIDIA GPU needs
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as err:
        raise ArcherError(f"{key}=true needs the liger-kernel package, which is not installed ({err})",
                          f"pip install liger-kernel, or set {key}=false") from err
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        log.warning("%s=true has no effect on this model: liger-kernel has no kernels for model_type %r",
                    key, model_type)
        return False
    _apply_liger_kernel_to_instance(model=model, **LIGER_KERNELS)
    return True
