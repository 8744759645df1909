"""A small server loop that plays vLLM's part for the plugin's slot logic
(trellis_lm.integrations.vllm.slots): a flat batch per step (decodes first, then prefill chunks
of different lengths), each sequence in its own slot of tensors that hold garbage from earlier
sequences. Used by tests/test_serving_slots.py (CPU, float64) and tests/test_on_cuda.py; and
:class:`CompiledRuns`, which counts the rows that ran compiled (there and in tests/vllm_serving)."""

from __future__ import annotations

import torch

from trellis_lm.integrations.vllm import compiled_rows
from trellis_lm.integrations.vllm.slots import SlotLayout, run_on_slots


def flat_forward(model, ids, starts, computed, slots, accepted, layers, compiled=False):
    """The model on a server's flat batch ``ids [N]``: each block's mixer over its slots."""
    hidden = model.model.embed_tokens(ids)
    for layer, (layout, tensors) in zip(model.model.layers, layers):
        hidden = layer.around(hidden, lambda x, layer=layer, layout=layout, tensors=tensors: run_on_slots(
            layer.self_attn, layout, tensors, x, starts, computed, slots, accepted, compiled))
    return model.lm_head(model.model.norm(hidden))


def serve(model, prompts, slot_of, step_tokens, slots=8, width=1, compiled=False):
    """Logits of every token of ``prompts`` (1-D rows on the model's device), computed as a
    server would: each step gives a sequence ``step_tokens(i, step)`` tokens, sequences ordered
    decodes (one token) first.

    ``step_tokens`` returns a number of tokens (0: the sequence waits, e.g. for its slot), or
    ``(kept, rejected)``: the sequence's next ``kept`` tokens, then ``rejected`` random ones (a
    draft the server rejects: it counts only the kept ones as taken in, and only their logits
    are returned; a row with rejected tokens holds at most ``width``). With ``width > 1``
    (speculative decoding) sequence i has a row of ``width`` slots, ``slot_of[i] * width`` on,
    read where its last row's kept tokens left its state, as vLLM keeps them (``run_on_slots``).
    ``compiled``: see ``run_on_slots``.
    """
    weight = model.model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    layers = []
    garbage = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        layout = SlotLayout(type(layer.self_attn), model.config, dtype)
        tensors = layout.allocate(slots * width, device)
        for t in tensors:  # what an earlier sequence left behind
            left = torch.randn(t.shape, generator=garbage, dtype=torch.float64) if t.is_floating_point() else 5
            t.copy_(left)
        layers.append((layout, tensors))
    done = [0] * len(prompts)
    accepted = [1] * len(prompts)
    logits = [[] for _ in prompts]
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for step in range(10**6):
            rows = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            if not rows:
                break
            plan = {i: step_tokens(i, step) for i in rows}
            plan = {i: (n, 0) if isinstance(n, int) else n for i, n in plan.items() if n}  # 0: not this step
            rows = list(plan)
            assert all(rejected == 0 or kept + rejected <= width for kept, rejected in plan.values())
            pieces = {i: torch.cat([prompts[i][done[i]: done[i] + kept],
                                    torch.randint(3, model.config.vocab_size, (rejected,), generator=noise).to(device)])
                      for i, (kept, rejected) in plan.items()}
            rows.sort(key=lambda i: len(pieces[i]) != 1)
            starts = torch.tensor([0] + [len(pieces[i]) for i in rows]).cumsum(0)
            # The step's metadata lives where the model does, as vLLM's does.
            step_slots = torch.tensor([[slot_of[i] * width + c for c in range(width)] for i in rows], device=device)
            out = flat_forward(model, torch.cat([pieces[i] for i in rows]), starts.to(device),
                               torch.tensor([done[i] for i in rows], device=device),
                               step_slots if width > 1 else step_slots[:, 0],
                               torch.tensor([accepted[i] if done[i] else 1 for i in rows], device=device), layers,
                               compiled)
            for j, i in enumerate(rows):
                kept = min(plan[i][0], len(prompts[i]) - done[i])
                logits[i].append(out[starts[j]: starts[j] + kept])
                done[i] += kept
                accepted[i] = kept if len(pieces[i]) <= width else 1
    return [torch.cat(parts) for parts in logits]


class CompiledRuns:
    """Every call of the compiled functions that ``advanced_compiled`` runs (``compiled_rows.
    _compiled_mixer``), as ``(kind, each, several rows)``: a row that ran compiled, not eagerly."""

    def __init__(self, monkeypatch) -> None:
        self.runs: list[tuple[str, bool, bool]] = []
        compiled_function = compiled_rows._compiled_mixer

        def counted(each: bool):
            function = compiled_function(each)

            def run(mixer, x, entry):
                self.runs.append((mixer.kind, each, x.shape[0] > 1))
                return function(mixer, x, entry)
            return run

        monkeypatch.setattr(compiled_rows, "_compiled_mixer", counted)
