"""How an op call finds its backend: one registry per op, one rule for all of them.

Each op (``trellis_attention``, ``lattice_attention``, ``kvm_attention``) keeps a
:class:`BackendRegistry` of :class:`Backend` entries. An entry says what it is (name, forward
function, optional single-token step), whether it can run here (:attr:`Backend.unavailable`:
an optional package, the tensors' device), which calls it computes (:attr:`Backend.unsupported`:
dtypes, op settings) and how much ``"auto"`` prefers it (:attr:`Backend.priority`).

* ``backend="auto"`` takes the entry of highest priority that can run the call, among those
  that ``auto`` may pick on the call's device (:attr:`Backend.auto_devices`).
* A named backend runs the call or raises a ``ValueError`` saying why it cannot: no request is
  quietly handed to another backend.
* One token per row (``T == 1``, not packed) runs the entry's :attr:`Backend.step` when it has
  one: the single-token form of the same function (a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch


@dataclass(frozen=True)
class OpCall:
    """What a call asks of a backend, as far as choosing one goes.

    Attributes:
        device: the inputs' device.
        dtype: the compute dtype (float32, or float64 for float64 inputs).
        length: ``T``, tokens per row.
        packed: whether ``cu_seqlens`` packs several sequences along T.
        settings: the op's settings that some backend may not implement (e.g. ``compress_fn``).
    """

    device: torch.device
    dtype: torch.dtype
    length: int
    packed: bool
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def single_token(self) -> bool:
        """One token per row and not packed: what a decode step is."""
        return self.length == 1 and not self.packed


def _runs_everything(call: OpCall) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Backend:
    """One way of computing an op (every backend of an op computes the same function).

    Attributes:
        name: what ``backend=`` and ``TrellisConfig.op_backend`` call it.
        forward: ``forward(*inputs, state, *settings, cu_seqlens) -> (o, final_state)``, the op's
            backend signature (each op's ``dispatch`` module states it).
        priority: ``auto`` takes the available entry of highest priority that supports the call.
        step: the single-token form for calls with one token per row, or ``None`` (``forward``
            serves those too).
        unavailable: why the backend cannot run on this machine or the call's device (``None``:
            it can), e.g. an optional package that does not import.
        unsupported: why the backend does not compute this call (``None``: it does), e.g. a
            dtype or an op setting its kernels do not implement.
        auto_devices: the device types on which ``auto`` may pick it (``None``: any). A backend
            that can run elsewhere only slowly (Triton's CPU interpreter) is still run there
            when named.
    """

    name: str
    forward: Callable
    priority: int
    step: Optional[Callable] = None
    unavailable: Callable[[OpCall], Optional[str]] = _runs_everything
    unsupported: Callable[[OpCall], Optional[str]] = _runs_everything
    auto_devices: Optional[tuple[str, ...]] = None

    def refusal(self, call: OpCall) -> Optional[str]:
        """Why this backend cannot run ``call`` (``None``: it can)."""
        return self.unavailable(call) or self.unsupported(call)

    def function_for(self, call: OpCall) -> Callable:
        """The function that runs ``call``: the step for one token per row, when there is one."""
        return self.step if self.step is not None and call.single_token else self.forward


class BackendRegistry(Mapping[str, Backend]):
    """The backends of one op, by name (a read-only mapping; :meth:`register` adds one).

    Args:
        op: the op's name, for error messages.
        backends: its entries.
    """

    def __init__(self, op: str, *backends: Backend) -> None:
        self.op = op
        self._entries: dict[str, Backend] = {}
        self._by_priority: list[Backend] = []  # highest first: what `auto` tries, in order
        self._single_token: dict[tuple, Callable] = {}
        for backend in backends:
            self.register(backend)

    def __getitem__(self, name: str) -> Backend:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"BackendRegistry({self.op!r}, {sorted(self._entries)})"

    def register(self, backend: Backend) -> None:
        """Add an entry; a name already taken is a ``ValueError`` (:meth:`unregister` it first)."""
        if backend.name == "auto" or backend.name in self._entries:
            raise ValueError(f"{self.op}: a backend named {backend.name!r} exists already (or is 'auto')")
        self._entries[backend.name] = backend
        self._sort()

    def unregister(self, name: str) -> Backend:
        """Remove and return the entry ``name``."""
        backend = self._entries.pop(name)
        self._sort()
        return backend

    def _sort(self) -> None:
        self._by_priority = sorted(self._entries.values(), key=lambda b: -b.priority)
        self._single_token = {}  # the entries changed: choose again

    def check_name(self, name: object) -> None:
        """``ValueError`` unless ``name`` is ``"auto"`` or one of this op's backends."""
        if name != "auto" and name not in self._entries:
            raise ValueError(f"backend must be 'auto' or one of {sorted(self._entries)} for {self.op}, got {name!r}")

    def choose(self, name: str, call: OpCall) -> Backend:
        """The entry that runs ``call`` when ``name`` is asked for (see the module doc)."""
        self.check_name(name)
        if name != "auto":
            backend = self._entries[name]
            reason = backend.refusal(call)
            if reason is not None:
                raise ValueError(
                    f"backend {name!r} cannot run this {self.op} call: {reason}. backend='auto' picks one that can"
                )
            return backend
        # A plain loop (no max(key=...)): decode steps run this inside torch.compile too.
        for backend in self._by_priority:
            if (backend.auto_devices is None or call.device.type in backend.auto_devices) and backend.refusal(call) is None:
                return backend
        reasons = "; ".join(f"{b.name}: {b.refusal(call) or 'not picked by auto on ' + call.device.type}"
                            for b in self._by_priority)
        raise ValueError(f"no backend of {self.op} can run this call ({reasons})")

    def function(self, name: str, call: OpCall) -> Callable:
        """The function that runs ``call`` under ``backend=name``."""
        return self.choose(name, call).function_for(call)

    def single_token(self, name: str, device: torch.device, dtype: torch.dtype, **settings: Any) -> Callable:
        """:meth:`function` for a decode step (one token per row, not packed), remembered per
        argument: a decode step asks it once per layer and token, and the answer depends only on
        them (``settings``: the op's settings a backend may not implement, hashable)."""
        key = (name, device, dtype, tuple(sorted(settings.items())))
        function = self._single_token.get(key)
        if function is None:
            function = self._single_token[key] = self.function(name, OpCall(device, dtype, 1, False, settings))
        return function
