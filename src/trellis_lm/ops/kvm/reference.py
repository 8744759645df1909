"""The per-token loop of the design page ``kvm.md``, section 1: slow, plain, and the ground truth.

One sequence at a time, vectorised over heads only; the state is kept as it is written on the
page (rows that grow by concatenation, the window as a list of tokens) and packed into the
buffers of a :class:`~.state.KVMState` only at the end. The fold ranks and assigns tokens with
Python loops, one head and one token at a time.
"""

from __future__ import annotations

import math

import torch

from ..varlen import per_sequence
from .functions import VALUE_EPS, KVMConfig, appended_rows, ln_s
from .state import KVMState, room_for


def _prep(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """``LN_s([0 ... 0, k[R:]])`` for ``k [H, L, Dk]``."""
    return ln_s(torch.cat([torch.zeros_like(k[..., :rope_dims]), k[..., rope_dims:]], dim=-1), weight, bias)


def _fold(sk, sv, radii, wk, wv, wg, position, covered, config: KVMConfig, weight, bias):
    """Fold one chunk (``wk [H, C, Dk]``, ``wv [H, C, Dv]``, ``wg [H, C]``) into the state
    ``sk [H, S, Dk]``, ``sv [H, S, Dv]``, ``radii [H, S]`` (S = 0 before the first fold)."""
    kp = _prep(wk, weight, bias, config.rope_dims)
    if sk.shape[1] == 0:  # the first fold: chunk 0 becomes the state, ungated
        return kp, wv, wv.norm(dim=-1)
    heads, chunk = wg.shape
    used = sk.shape[1]
    n_app = int(appended_rows(
        config, torch.tensor([position]), torch.tensor([covered + chunk]), torch.tensor([used])
    )[0])
    gk, gv = wg[..., None] * kp, wg[..., None] * wv

    # Append: the n_app tokens least like any current row, in their chunk order.
    appended = []
    with torch.no_grad():
        ln_old = ln_s(sk, weight, bias)
        for h in range(heads):
            score = [max((kp[h, m] * ln_old[h, i]).sum().item() for i in range(used)) for m in range(chunk)]
            ranked = sorted(range(chunk), key=lambda m: score[m])  # Python's sort is stable
            appended.append(sorted(ranked[:n_app]))
    sk1 = torch.stack([torch.cat([sk[h], gk[h, appended[h]]]) for h in range(heads)])
    sv1 = torch.stack([torch.cat([sv[h], gv[h, appended[h]]]) for h in range(heads)])
    radii1 = torch.stack([torch.cat([radii[h], gv[h, appended[h]].norm(dim=-1)]) for h in range(heads)])

    # Merge: every other token into its most similar non-sink row of the state after appending.
    sk2, sv2 = [], []
    with torch.no_grad():
        ln_new = ln_s(sk1, weight, bias)
    for h in range(heads):
        merged = [m for m in range(chunk) if m not in appended[h]]
        winners = []
        for m in merged:
            sims = [(kp[h, m] * ln_new[h, i]).sum().item() for i in range(sk1.shape[1])]
            best = config.sinks
            for i in range(config.sinks, len(sims)):
                if sims[i] > sims[best]:  # strict: the first index wins ties
                    best = i
            winners.append(best)
        index = torch.tensor(winners, dtype=torch.long)
        sk2.append(sk1[h].index_add(0, index, gk[h, merged]))
        sv2.append(sv1[h].index_add(0, index, gv[h, merged]))
    return torch.stack(sk2), torch.stack(sv2), radii1


def _run_sequence(q, k, v, gate, state: KVMState, config: KVMConfig, weight, bias, temperature) -> tuple:
    """One sequence: ``q [T, H, Dk]`` etc. and a one-row state; returns ``(o [T, H, Dv], state)``."""
    chunk, blocks = config.chunk_size, config.window_chunks
    seen, covered, used = int(state.seen[0]), int(state.covered[0]), int(state.used[0])
    sk, sv, radii = state.keys[0, :, :used], state.values[0, :, :used], state.radii[0, :, :used]
    n_win = seen - covered
    win_k = list(state.window_k[0, :, :n_win].unbind(1))  # tokens of [H, Dk]
    win_v = list(state.window_v[0, :, :n_win].unbind(1))
    win_g = list(state.window_g[0, :, :n_win].unbind(1))
    t_s, t_w = temperature[:, 0, None, None], temperature[:, 1, None, None]
    scale = 1.0 / math.sqrt(q.shape[-1])
    outputs = []
    read_k = read_v = None
    for i in range(q.shape[0]):
        p = seen + i
        j = p // chunk
        if p % chunk == 0 and j >= blocks:
            assert len(win_k) == blocks * chunk and covered == (j - blocks) * chunk
            sk, sv, radii = _fold(
                sk, sv, radii, torch.stack(win_k[:chunk], 1), torch.stack(win_v[:chunk], 1),
                torch.stack(win_g[:chunk], 1), p, covered, config, weight, bias,
            )
            win_k, win_v, win_g = win_k[chunk:], win_v[chunk:], win_g[chunk:]
            covered += chunk
            read_k = None
        if read_k is None:  # the state's read-out changes only at folds
            read_k = t_s * ln_s(sk, weight, bias)
            read_v = radii[..., None] * sv / sv.norm(dim=-1, keepdim=True).clamp_min(VALUE_EPS)
        win_k.append(k[i])
        win_v.append(v[i])
        win_g.append(gate[i])
        keys = torch.cat([read_k, t_w * torch.stack(win_k, 1)], dim=1)  # [H, S + w, Dk]
        values = torch.cat([read_v, torch.stack(win_v, 1)], dim=1)
        logits = (keys @ q[i][..., None])[..., 0] * scale
        outputs.append((torch.softmax(logits, dim=-1)[:, None, :] @ values)[:, 0])
    o = torch.stack(outputs) if outputs else v.new_zeros(v.shape)

    heads, (size, window) = state.keys.shape[1], state.room

    def pad(x: torch.Tensor, n: int) -> torch.Tensor:  # [H, L, *] -> [1, H, n, *], zeros after L
        return torch.cat([x, x.new_zeros((heads, n - x.shape[1]) + tuple(x.shape[2:]))], dim=1)[None]

    def window_of(tokens: list, like: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(tokens, 1) if tokens else like[0, :, :0]
        return pad(stacked, window)

    final = KVMState(
        pad(sk, size), pad(sv, size), pad(radii, size), torch.tensor([sk.shape[1]]),
        window_of(win_k, state.window_k), window_of(win_v, state.window_v), window_of(win_g, state.window_g),
        torch.tensor([seen + q.shape[0]]), torch.tensor([covered]),
    )
    return o, final


def reference_forward(q, k, v, gate, norm_weight, norm_bias, temperature, state, config, cu_seqlens):
    """Backend ``"reference"``; arguments as validated by :func:`trellis_lm.ops.kvm_attention`."""
    lengths = [q.shape[1]] * q.shape[0] if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    # Every sequence's final state in buffers enough for all of them, so they stack.
    state = state.with_room(*room_for(config, [s + n for s, n in zip(state.seen.tolist(), lengths)]))

    def run(q, k, v, gate, state):
        outputs, finals = [], []
        for n in range(q.shape[0]):
            o, final = _run_sequence(
                q[n], k[n], v[n], gate[n], state.map(lambda t: t[n : n + 1]), config, norm_weight, norm_bias,
                temperature,
            )
            outputs.append(o)
            finals.append(final.map(lambda t: t.to(state.seen.device)))
        return torch.stack(outputs), KVMState.cat(finals)

    return per_sequence(run, (q, k, v, gate), state, cu_seqlens)
