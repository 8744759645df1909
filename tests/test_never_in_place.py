"""The rule that rollback, all-or-nothing updates and the vLLM slots rest on: a cache entry's
tensors are replaced, never written in place.

torch counts every in-place write to a tensor (and to any view sharing its storage) in the
tensor's ``_version``. Each test keeps every tensor an entry held at any point, with its count
then, and checks after every later call that none of them was written: calls of several tokens,
decode steps (eager, and generate's decode plan), a crop replaying kept tokens, and state
passing's training calls with their backward.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_tokens, schedules_ci_sized, tiny_model

from trellis_lm import TrellisCache
from trellis_lm.state_passing import StatePassing


class Held:
    """Every tensor that entries held, with its version count when first seen."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, int, str]] = {}

    def add(self, tensors, when: str) -> None:
        """``tensors``: ``(name, tensor)`` pairs."""
        for name, tensor in tensors:
            self.seen.setdefault(id(tensor), (tensor, tensor._version, f"{name}, held {when}"))

    def add_cache(self, cache: TrellisCache, when: str) -> None:
        self.add([(f"layer {index} {name}", tensor) for index, layer in enumerate(cache.layers)
                  for name, tensor in layer.tensors().items()], when)

    def check(self, after: str) -> None:
        written = [where for tensor, version, where in self.seen.values() if tensor._version != version]
        assert not written, f"written in place by {after}: {written}"


@pytest.mark.parametrize("schedule", schedules_ci_sized("hybrid"))
def test_calls_steps_and_a_crop_write_no_entry_in_place(schedule):
    model = tiny_model(seed=3, schedule=schedule)
    ids = random_tokens(2, 16, seed=4)
    held = Held()
    with torch.no_grad():
        cache = TrellisCache(model.config, rollback_window=5)
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12), (12, 13)):
            model(ids[:, start:end], cache=cache)
            held.check(f"the call of tokens {start}..{end}")
            held.add_cache(cache, f"after tokens {start}..{end}")
        cache.crop(10)  # replays kept tokens through the recorded functions
        held.check("the crop")
        held.add_cache(cache, "after the crop")
        model(ids[:, 10:11], cache=cache)
        held.check("a step after the crop")


@pytest.mark.parametrize("schedule", schedules_ci_sized("hybrid"))
def test_generate_s_decode_steps_write_no_entry_in_place(schedule):
    model = tiny_model(seed=5, schedule=schedule)
    ids = random_tokens(2, 6, seed=6)
    cache, held = TrellisCache(model.config), Held()

    def after_step(module, args, output):
        held.check("a step of generate")
        held.add_cache(cache, "during generate")

    handle = model.register_forward_hook(after_step)
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5,
                       do_sample=False)
    finally:
        handle.remove()
    assert len(held.seen) > 0 and cache.get_seq_length() == 10  # (the hook saw the steps)


def test_state_passing_writes_no_carried_entry_in_place():
    """A training call starts from the carried entries (rows picked, some reset) and leaves its
    final ones: neither the carried nor the final tensors are written by the next call, nor by
    its backward."""
    model = tiny_model(seed=7, schedule="kvm-hybrid").train()
    ids = random_tokens(2, 9, seed=8)
    held = Held()
    with StatePassing(probability=0.5, seed=0).attached(model) as passing:
        for step in range(3):
            model(ids, labels=ids).loss.backward()
            held.check(f"training call {step}")
            carried = []
            for index, entry in passing.carried.items():
                entry.map(lambda t, index=index: carried.append((f"layer {index}", t)) or t)
            held.add(carried, f"after training call {step}")
    assert len(held.seen) > 0
