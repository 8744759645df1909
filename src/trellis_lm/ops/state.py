"""What every op's carried state shares: a dataclass of tensors with the sequences on dim 0."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence, TypeVar

import torch

StateT = TypeVar("StateT", bound="OpState")


@dataclass
class OpState:
    """Base of the op states: every field is a tensor whose dim 0 indexes sequences."""

    def map(self: StateT, fn: Callable[[torch.Tensor], torch.Tensor]) -> StateT:
        """Apply ``fn`` to every tensor (e.g. ``lambda t: t.index_select(0, idx)``)."""
        return type(self)(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def cat(cls: type[StateT], states: Sequence[StateT]) -> StateT:
        """The states of several groups of sequences as one, in order."""
        return cls(**{name: torch.cat([getattr(s, name) for s in states]) for name in cls.field_names()})

    @property
    def lead(self) -> torch.Tensor:
        """The first field: a float tensor in every op's state, whose dtype and device are the state's."""
        return getattr(self, fields(self)[0].name)

    @property
    def rows(self) -> int:
        """Sequences held (N)."""
        return next(iter(self.tensors().values())).shape[0]
