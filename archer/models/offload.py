"""verl's ``fsdp_config.param_offload`` / ``optimizer_offload`` on one device: host copies of what the card need
not hold at a stage.

- ``param_offload``: the float32 policy weights live in host memory while the engine generates (the engine has its
  own bf16 copy) and come back for the log-prob pass and the update;
- ``optimizer_offload``: Adam's states live in host memory except during the optimiser step.

Tensors move into host buffers allocated once per tensor (pinned when a GPU is present, so the copies run at
full PCIe speed) and back with ``.to(device)``; the Parameter objects stay the same, so the optimiser's state keeps
its keys. ``host`` is the CPU unless a test names another device. On a CPU-only run the moves are copies within
host memory (same values, different storage), so the logic runs there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class HostCopies:
    """One host buffer per offloaded tensor (keyed by the caller), reused across moves."""

    def __init__(self, host: torch.device) -> None:
        self.host = host
        self.pin = host.type == "cpu" and torch.cuda.is_available()
        self.buffers: dict[tuple, torch.Tensor] = {}

    def store(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in the host buffer of ``key`` (returned)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.host, pin_memory=self.pin)
            self.buffers[key] = buffer
        buffer.copy_(tensor.detach(), non_blocking=self.pin)
        return buffer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Offload:
    """Moves the policy's parameters and the optimiser's states between ``device`` and host buffers."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, device: torch.device,
                 *, param_offload: bool, optimizer_offload: bool, host: torch.device | None = None) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.device = device
        self.param_offload, self.optimizer_offload = param_offload, optimizer_offload
        self.copies = HostCopies(host or torch.device("cpu"))

    def params_to_host(self) -> None:
        """With param_offload: every parameter's values into its host buffer (gradients must be None)."""
        if not self.param_offload:
            return
        for i, p in enumerate(self.params):
            p.data = self.copies.store(("param", i), p.data)
        _synchronize(self.device)

    def params_to_device(self) -> None:
        if not self.param_offload:
            return
        for p in self.params:
            p.data = p.data.to(self.device, non_blocking=True)
        _synchronize(self.device)

    def optimizer_to_host(self) -> None:
        """With optimizer_offload: every state tensor but Adam's step counts into its host buffer."""
        if self.optimizer_offload:
            self._move_states(lambda key, t: self.copies.store(key, t))

    def optimizer_to_device(self) -> None:
        if self.optimizer_offload:
            self._move_states(lambda key, t: t.to(self.device, non_blocking=True))

    def _move_states(self, move) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        for param, state in self.optimizer.state.items():
            for name, value in state.items():
                if torch.is_tensor(value) and name != "step":
                    state[name] = move(("state", index.get(id(param), id(param)), name), value)
        _synchronize(self.device)

    @contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Adam's states on the device for the body (the optimiser step), in host memory after it."""
        self.optimizer_to_device()
        try:
            yield
        finally:
            self.optimizer_to_host()
