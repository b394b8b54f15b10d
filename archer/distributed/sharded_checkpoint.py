"""Sharded checkpoints of a model and its optimizer (torch distributed checkpoint, DCP), and a single-process
checkpoint read into a sharded model.

``save_sharded`` writes one file per rank plus ``.metadata`` (keys are the parameters' fully qualified names,
the plain HF names with peft's ``lora_A`` / ``lora_B`` inside LoRA layers; the optimizer state keyed by the
same names). ``load_sharded`` reads it back at any world size: DCP reshards, so a checkpoint written by 2
ranks resumes in one process without a process group (and the other way round). Frozen parameters (a LoRA
model's base) are not saved: they come from the model folder the run starts from. DCP does not promise to
read checkpoints of another torch version.

The HF folder beside them (what ``from_pretrained`` loads, LoRA merged) is ``archer.models.lora.save_merged``'s.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from archer.distributed.context import DistContext
from archer.distributed.fsdp import unwrap
from archer.errors import ArcherError

METADATA = ".metadata"
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Frozen weights are absent from the checkpoint; every trainable one is read (dcp.load fails on a missing key).
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


@contextlib.contextmanager
def _single_process_quiet(ctx: DistContext) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what world 1 means."""
    with warnings.catch_warnings():
        if not ctx.distributed:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, dict]:
    """The model's (and optimizer's) state by FQN: DTensor shards on a sharded model, tensors otherwise."""
    root = unwrap(model)
    if optimizer is None:
        return {"model": get_state_dict(root, [], options=_OPTIONS)[0]}
    model_state, optim_state = get_state_dict(root, optimizer, options=_OPTIONS)
    return {"model": model_state, "optimizer": optim_state}


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: DistContext) -> Path:
    """Write the trainable weights and the optimizer state (when given) into ``directory``: every rank its
    own shards. All ranks call it; the directory should be on storage all nodes share."""
    folder = Path(directory)
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    with _single_process_quiet(ctx):
        dcp.save(_state(model, optimizer), checkpoint_id=folder, no_dist=not ctx.distributed)
    ctx.barrier()
    return folder


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: DistContext) -> None:
    """Load a ``save_sharded`` checkpoint into ``model`` (already sharded, or plain at world 1) and
    ``optimizer`` (built over the model's trainable parameters), whatever world size wrote it. All ranks
    call it. An ArcherError names the folder when it holds no checkpoint or one of another model."""
    folder = Path(directory)
    if not (folder / METADATA).is_file():
        raise ArcherError(f"{folder} holds no sharded checkpoint (no {METADATA})",
                          "point at the dcp/ folder of a checkpoint written with several ranks")
    state = _state(model, optimizer)
    try:
        with _single_process_quiet(ctx):
            dcp.load(state, checkpoint_id=folder, no_dist=not ctx.distributed)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as err:
        raise ArcherError(f"the sharded checkpoint in {folder} does not fit this model / optimizer "
                          f"({type(err).__name__}: {str(err)[:500]})",
                          "resume with the model and LoRA settings the checkpoint was written with") from err
    set_state_dict(unwrap(model), optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}),
                   options=_LOAD_OPTIONS)


def load_full_state(model_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    optim_state: dict, ctx: DistContext) -> None:
    """A single-process checkpoint into a sharded model (a run resumed on more ranks): the full weights of the
    HF folder ``model_dir`` and ``optim_state``, ``optimizer.state_dict()`` of the single process (its
    parameters numbered in the order of the model's trainable parameters, the order the optimiser was built
    in). Every rank reads the whole folder and keeps its shards. All ranks call it."""
    from safetensors.torch import load_file

    root = unwrap(model)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    trainable = [name for name, param in root.named_parameters() if param.requires_grad]
    groups = optim_state["param_groups"]
    numbered = [index for group in groups for index in group["params"]]
    if len(numbered) != len(trainable):
        raise ArcherError(f"the optimiser state beside {model_dir} has {len(numbered)} parameters, this model "
                          f"{len(trainable)} trainable ones", "resume with the model the checkpoint was written with")
    name_of = dict(zip(numbered, trainable, strict=True))
    full_optim = {"state": {name_of[index]: state for index, state in optim_state["state"].items()},
                  "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in groups]}
    options = StateDictOptions(full_state_dict=True, strict=False)
    try:
        set_state_dict(root, optimizer, model_state_dict=weights, optim_state_dict=full_optim, options=options)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ArcherError(f"the checkpoint in {model_dir} does not fit this model ({type(err).__name__}: "
                          f"{str(err)[:500]})", "resume with the model the checkpoint was written with") from err
    ctx.barrier()
