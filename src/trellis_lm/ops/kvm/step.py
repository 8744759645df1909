"""The single-token step of the torch backend: what decoding runs once per layer and token.

The loop body of the design page ``kvm.md`` (section 1) for one token per row. The chunked form
would lay the token out on a grid of ``W + C`` cells and rebuild every window key and state
read-out of that grid, so a decode step cost like a whole chunk; here a step touches the
state rows and the window once, ``O((S + W) d)``, plus the fold on the steps that start a
chunk with a full window (every C-th step of a row, and only in the rows that need it).

Same function as :mod:`.reference` and :mod:`.chunked` (``tests/test_kvm_ops.py``): the fold is
:func:`.chunked._fold` itself, and the attention is the page's single softmax over
``[state rows ; window]``, computed as two matrix-vector products whose logits are joined
before the softmax, so neither keys nor values are copied into one tensor. Every operation is
differentiable where the page says gradients flow, so gradients match the reference too.

Like the other backends the step returns a new state and never writes the caller's: appending
the token copies the window (``O(W d)``, the size of what the attention reads anyway). The
host reads one flag per step (does any row fold?, with the rows' positions while the state's
buffers are still growing, see :class:`~.state.KVMState`), so the step runs eagerly.
"""

from __future__ import annotations

import math

import torch

from .chunked import _fold
from .functions import LN_EPS, VALUE_EPS, KVMConfig, ln_s
from .state import KVMState, room_for


def _shift_window(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Drop the window's first chunk: ``x [n, H, W, *]`` -> slots ``C ..`` moved to the front,
    zeros after (the state's invariant: slots past the window's tokens are zero)."""
    return torch.cat([x[:, :, chunk:], torch.zeros_like(x[:, :, :chunk])], dim=2)


def _fold_rows(state: KVMState, folds: torch.Tensor, config: KVMConfig, weight: torch.Tensor,
               bias: torch.Tensor) -> KVMState:
    """Fold the window's first chunk into the state of the rows where ``folds [N]`` is set.

    Those rows have a full window (``seen - covered == W``) and their next token starts a
    chunk. Only they are computed: a batch at mixed phases pays one fold per folding row.
    """
    chunk = config.chunk_size
    every = bool(folds.all())
    rows = None if every else folds.nonzero()[:, 0]

    def pick(x: torch.Tensor) -> torch.Tensor:
        return x if every else x.index_select(0, rows)

    def put(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new if every else x.index_copy(0, rows, new)  # out of place: autograd sees both

    sk, sv, radii, used, covered = (pick(t) for t in (state.keys, state.values, state.radii, state.used, state.covered))
    wk, wv, wg = (pick(t) for t in (state.window_k, state.window_v, state.window_g))
    zeroed = torch.cat([torch.zeros_like(wk[:, :, :chunk, : config.rope_dims]), wk[:, :, :chunk, config.rope_dims :]], -1)
    kp = ln_s(zeroed, weight, bias)  # prep(k) of the chunk leaving the window, [n, H, C, Dk]
    with torch.no_grad():  # only ranks and picks winners (piecewise constant)
        ln_old = ln_s(sk, weight, bias)
    # The token about to be processed sits at position `seen`, the `t` of the page's fold.
    sk, sv, radii, used = _fold(
        sk, sv, radii, used, covered, ln_old, kp, wv[:, :, :chunk], wg[:, :, :chunk], pick(state.seen), config,
        weight, bias,
    )
    return KVMState(
        put(state.keys, sk), put(state.values, sv), put(state.radii, radii), put(state.used, used),
        put(state.window_k, _shift_window(wk, chunk)), put(state.window_v, _shift_window(wv, chunk)),
        put(state.window_g, _shift_window(wg, chunk)), state.seen, put(state.covered, covered + chunk),
    )


def step_forward(q, k, v, gate, norm_weight, norm_bias, temperature, state: KVMState, config: KVMConfig, cu_seqlens):
    """One token per row (``T == 1``, no ``cu_seqlens``); arguments as validated by
    :func:`trellis_lm.ops.kvm_attention`.

    Shapes: ``q, k [N, 1, H, Dk]``, ``v [N, 1, H, Dv]``, ``gate [N, 1, H]``; ``norm_weight``,
    ``norm_bias [H, Dk]``; ``temperature [H, 2]``; the state's rows may be at different
    phases (their own ``seen``, ``covered``, ``used``). Returns ``o [N, 1, H, Dv]`` and the state
    after the token.
    """
    assert cu_seqlens is None and q.shape[1] == 1, "the step takes one token per row"
    # The page folds when the token starts chunk j >= B; then, and only then, the window holds
    # all W tokens of chunks j-B .. j-1 (dispatch checks that `covered` agrees with `seen`,
    # unless its caller vouches for the state with check_values=False).
    folds = state.seen - state.covered == config.window
    if state.room == (config.state_size, config.window):
        any_fold = bool(folds.any())
    else:  # buffers still growing: their sizes come from the positions, read with the flag
        any_fold, *seen = torch.cat([folds.any().view(1).long(), state.seen]).tolist()
        state = state.with_room(*room_for(config, [s + 1 for s in seen]))
    if any_fold:
        state = _fold_rows(state, folds, config, norm_weight, norm_bias)

    # Append the token's k, v, g at its slot (position seen, slot seen - covered < W), by one
    # scatter each (several times faster on CPUs than a select against a one-hot of the slots).
    rows, heads, dk, dv = q.shape[0], q.shape[2], q.shape[-1], v.shape[-1]
    slot = state.seen - state.covered  # [N]
    index = slot.view(rows, 1, 1, 1).expand(rows, heads, 1, max(dk, dv))
    win_k = state.window_k.scatter(2, index[..., :dk], k.transpose(1, 2))
    win_v = state.window_v.scatter(2, index[..., :dv], v.transpose(1, 2))
    win_g = state.window_g.scatter(2, index[..., 0], gate.transpose(1, 2))

    # One softmax over [state rows ; window]: state rows < used, window slots <= the token's.
    # The query is a row vector ([N, H, 1, Dk] @ [.., Dk, L]): torch's CPU batched matmul is
    # several times faster this way round than as matrix @ column. LN_s's scale, affine and
    # both temperatures move off the [S, Dk] keys, which are only centred (F.layer_norm is
    # slower on CPU than these few passes at this size):
    # t_s (LN(sk) w + b) . q = ((sk - mean) . (t_s w q)) / sqrt(var + eps) + t_s b . q.
    query = q[:, 0, :, None, :] * (1.0 / math.sqrt(dk))  # [N, H, 1, Dk]
    t_s, t_w = temperature[:, 0, None, None], temperature[:, 1, None, None]  # [H, 1, 1]
    q_s = query * t_s
    centred = state.keys - state.keys.mean(dim=-1, keepdim=True)  # [N, H, S, Dk]
    inv_std = (centred.square().mean(dim=-1) + LN_EPS).rsqrt()[:, :, None]  # [N, H, 1, S]
    bias = (q_s * norm_bias[:, None, :]).sum(-1, keepdim=True)  # [N, H, 1, 1]
    state_logits = ((q_s * norm_weight[:, None, :]) @ centred.transpose(-1, -2)) * inv_std + bias  # [N, H, 1, S]
    window_logits = (query * t_w) @ win_k.transpose(-1, -2)  # [N, H, 1, W']
    # Visible: state rows < used, window slots <= the token's (masks of [N, 1, 1, *]).
    size, window = state.room
    hidden_rows = (torch.arange(size, device=q.device) >= state.used[:, None])[:, None, None]
    logits = torch.cat([
        state_logits.masked_fill(hidden_rows, -math.inf),
        window_logits.masked_fill((torch.arange(window, device=q.device) > slot[:, None])[:, None, None], -math.inf),
    ], dim=-1)
    weights = torch.softmax(logits, dim=-1)  # [N, H, 1, R + W']
    # A state row reads as r SV / |SV|: the per-row factor r / |SV| goes onto its weight.
    sv = state.values
    factor = state.radii / sv.norm(dim=-1).clamp_min(VALUE_EPS)  # [N, H, S]
    o = (weights[..., :size] * factor[:, :, None]) @ sv + weights[..., size:] @ win_v  # [N, H, 1, Dv]

    final = KVMState(
        state.keys, state.values, state.radii, state.used, win_k, win_v, win_g, state.seen + 1, state.covered,
    )
    return o.transpose(1, 2), final
