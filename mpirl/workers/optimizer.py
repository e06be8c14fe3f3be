"""The learners' optimizer: ``torch.optim.Adam`` without importing ``torch._dynamo``; and the
learning-rate schedule the drivers of DQN and IMPALA send with each training call
(``decayed_lr``).

Torch wraps ``Optimizer.add_param_group``, ``state_dict``, ``load_state_dict`` and ``zero_grad``
(``torch._disable_dynamo``) and ``Adam.step`` so that each imports ``torch._dynamo`` the first time
it runs, to keep the compiler out of them. That import takes about a second (1.0 s on this 2-core
VM, with sympy: 74 MB), on rank 0's start-up path, for a compiler mpirl does not use.

``Adam`` runs the same methods, unwrapped, while ``torch._dynamo`` is not imported: then no
compiled frame can be running, so there is nothing to keep the compiler out of. Once something has
imported it (a custom model that uses ``torch.compile``, say), each method goes through torch's
own wrapper again. The update and the ``state_dict`` are torch's, bit for bit: checkpoints of
either class load into the other.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["decayed_lr"]

_Optimizer = torch.optim.Optimizer
_RAW = {name: inspect.unwrap(getattr(_Optimizer, name))
        for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad")}
_RAW_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)


def _dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` whose construction, ``step``, ``zero_grad`` and state (de)serialization
    do not import ``torch._dynamo``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, eps: float = 1e-5
                 ) -> None:
        super().__init__(params, lr=lr, eps=eps)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _dynamo_imported():
            return super().add_param_group(param_group)
        return _RAW["add_param_group"](self, param_group)

    def state_dict(self) -> dict[str, Any]:
        if _dynamo_imported():
            return super().state_dict()
        return _RAW["state_dict"](self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _dynamo_imported():
            return super().load_state_dict(state_dict)
        return _RAW["load_state_dict"](self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_imported():
            return super().zero_grad(set_to_none)
        return _RAW["zero_grad"](self, set_to_none)

    def step(self, closure: Any = None) -> Any:
        if _dynamo_imported():
            return super().step(closure)
        # What torch's wrapper does besides the import: the update runs outside autograd.
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return _RAW_ADAM_STEP(self, closure)
        finally:
            torch.set_grad_enabled(previous)


def decayed_lr(lr: float, lr_final: float, decay_steps: int, timesteps: int) -> float:
    """The learning rate after ``timesteps`` env steps: from ``lr`` linearly to ``lr_final``
    over ``decay_steps`` (0 keeps ``lr``), then ``lr_final``. Computed on the driver from
    ``timesteps_total``, so a resumed run continues the schedule; it crosses to the learners
    as the ``lr`` argument of their training calls."""
    if not decay_steps:
        return lr
    fraction = min(1.0, timesteps / decay_steps)
    return lr + fraction * (lr_final - lr)
