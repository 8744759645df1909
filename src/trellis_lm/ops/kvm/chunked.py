"""The chunked form of the design page ``kvm.md``, section 2, in batched PyTorch.

The state changes only at chunk starts, so the loop over chunks only folds; all queries then
attend at once, each chunk over its own snapshot of the state and its window, through
``scaled_dot_product_attention``.

Layout: every sequence gets a row of a grid that starts at its window's first token (position
``covered``, a multiple of C), so the carried window fills the first ``seen - covered`` cells,
the new tokens follow, and grid chunk ``c`` is the sequence's chunk ``covered / C + c``. The
chunk a fold takes out of the window is then grid chunk ``c - B``, present in every row that
folds, and the window of grid chunk ``c`` is grid chunks ``c - B + 1 .. c``. Sequences that
resume at different points, or have different lengths (``cu_seqlens``), share the loop: each
row folds only where its own tokens say so.

The grid holds the tokens present, not C or W: it ends with the last chunk that holds a token,
a window reaches back only over grid chunks (cells before the grid hold no token), and when
every row's tokens fit in one chunk (then nothing folds: a fold takes a chunk B >= 1 chunks
back) that chunk is only as wide as the fullest row. A 40-token call costs the same at
C = 10**9 as at C = 40.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import from_chunks, stream_grid_positions, to_chunks
from .functions import VALUE_EPS, KVMConfig, appended_rows, ln_s
from .state import KVMState, room_for


def _lay_out(x: torch.Tensor, carried: torch.Tensor, n_win: torch.Tensor, flat_index, rows: int, grid: int, width: int):
    """New tokens ``x [B, T, H, *]`` after the carried window ``[N, H, W', *]``: ``[N, H, grid, *]``
    (grid chunks of ``width`` cells)."""
    batch, length, heads = x.shape[:3]
    rest = tuple(x.shape[3:])
    cells = to_chunks(x.reshape((batch * length, heads) + rest), flat_index, rows, grid // width, width).flatten(2, 3)
    carried = carried[:, :, :grid]  # the window's tokens lie in the grid; the slots after them are zero
    window = carried.shape[2]
    live = torch.arange(window, device=x.device) < n_win[:, None]  # [N, W]
    carried = carried * live.view((rows, 1, window) + (1,) * len(rest)).to(carried.dtype)
    # The carried tokens and the new ones occupy different cells, so a sum places both.
    return cells + F.pad(carried, (0, 0) * len(rest) + (0, grid - window))


def _fold(sk, sv, radii, used, covered, ln_old, kp, vc, gc, position, config: KVMConfig, weight, bias):
    """Fold one chunk per row into the state; returns the new ``(sk, sv, radii, used)``.

    Shapes: ``sk [N, H, S, Dk]``, ``sv [N, H, S, Dv]``, ``radii [N, H, S]``, ``used``,
    ``covered``, ``position [N]``; the chunk's prepared keys ``kp [N, H, C, Dk]``, values
    ``vc [N, H, C, Dv]`` and gates ``gc [N, H, C]``; ``ln_old = LN_s(sk)``. Append and merge are
    one scatter, every token to one row (its new slot or its winner); which row is piecewise
    constant, so it is chosen without gradients.
    """
    chunk, size = config.chunk_size, sk.shape[2]
    first = covered == 0  # chunk 0 becomes the state: all C tokens appended, ungated
    n_app = torch.where(first, chunk, appended_rows(config, position, covered + chunk, used))
    gate = torch.where(first[:, None, None], torch.ones_like(gc), gc)[..., None]
    row = torch.arange(size, device=sk.device)
    live = row < used[:, None]  # [N, S]
    keep = live[:, None, :, None].to(sk.dtype)  # rows past `used` start from zero
    gk, gv = gate * kp, gate * vc
    with torch.no_grad():
        sims = (kp @ ln_old.transpose(-1, -2)).masked_fill_(~live[:, None, None, :], float("-inf"))
        order = sims.amax(-1).argsort(dim=-1, stable=True)  # least like any row first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(chunk, device=sk.device).expand_as(order))
        appended = rank < n_app[:, None, None]  # [N, H, C]
        slot = (used[:, None, None] + appended.cumsum(-1) - 1).clamp_(0, size - 1)  # in chunk order
        sk1 = (sk * keep).scatter_add_(2, slot[..., None].expand_as(gk), gk * appended[..., None])
        # Winners among the rows after appending, sinks excluded; argmax keeps the first on ties.
        target = (row >= config.sinks) & (row < (used + n_app)[:, None])
        sims = (kp @ ln_s(sk1, weight, bias).transpose(-1, -2)).masked_fill_(~target[:, None, None, :], float("-inf"))
        to = torch.where(appended, slot, sims.argmax(-1))[..., None]  # [N, H, C, 1]
    sk_new = (sk * keep).scatter_add(2, to.expand_as(gk), gk)
    sv_new = (sv * keep).scatter_add(2, to.expand_as(gv), gv)
    radii_new = (radii * keep[..., 0]).scatter_add(2, to[..., 0], gv.norm(dim=-1) * appended)
    return sk_new, sv_new, radii_new, used + n_app


def chunked_forward(q, k, v, gate, norm_weight, norm_bias, temperature, state: KVMState, config: KVMConfig, cu_seqlens):
    """Backend ``"torch"``; arguments as validated by :func:`trellis_lm.ops.kvm_attention`."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    chunk, blocks = config.chunk_size, config.window_chunks
    rows = state.seen.numel()
    n_win = state.seen - state.covered
    base = state.covered // chunk
    if cu_seqlens is None:
        lengths = torch.full_like(n_win, length)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(n_win.device)
    # Which rows fold at which chunk is decided on the host from the counters, read back once:
    # no device reads in the loop, and no row selects when every row folds.
    n_win_h, lengths_h, base_h = torch.stack([n_win, lengths, base]).tolist() if rows else ([], [], [])
    span = max((n + m for n, m in zip(n_win_h, lengths_h)), default=1)
    width = max(min(chunk, span), 1)  # cells per grid chunk: fewer than C only when nothing folds
    state = state.with_room(*room_for(config, [b * chunk + n + m for n, m, b in zip(n_win_h, lengths_h, base_h)]))
    flat_index, lengths, grid = stream_grid_positions(n_win, batch, length, cu_seqlens, width)
    chunks = grid // width
    # Grid chunks a window spans: B, or all of the grid when it has fewer (none lie before it).
    reach = min(blocks, chunks)
    window = reach * width

    def lay_out(x, carried):
        return _lay_out(x, carried, n_win, flat_index, rows, grid, width)

    kg = lay_out(k, state.window_k)  # [N, H, grid, Dk]
    vg = lay_out(v, state.window_v)
    gg = lay_out(gate, state.window_g)  # [N, H, grid]
    qg = to_chunks(q.reshape(batch * length, heads, dk), flat_index, rows, chunks, width)  # [N, H, chunks, L, Dk]
    zeroed = torch.cat([torch.zeros_like(kg[..., : config.rope_dims]), kg[..., config.rope_dims :]], dim=-1)
    kp_all = ln_s(zeroed, norm_weight, norm_bias)

    # Fold chunk by chunk; keep every chunk's read-out of the state for the attention below.
    sk, sv, radii, used, covered = state.keys, state.values, state.radii, state.used, state.covered
    first_chunk = min(n // width for n in n_win_h) if rows else 0  # earlier chunks hold no new query
    t_s, t_w = temperature[:, 0, None, None], temperature[:, 1, None, None]
    ln_cur = ln_s(sk, norm_weight, norm_bias)
    read_k, read_v, read_live = [], [], []
    row = torch.arange(sk.shape[2], device=sk.device)
    # Per-chunk views by one unbind each: slicing in the loop would give every fold backward
    # nodes that scatter into zero-filled tensors as large as the whole grid.
    kp_c, vg_c, gg_c = (x.unflatten(2, (chunks, width)).unbind(2) for x in (kp_all, vg, gg))
    for c in range(first_chunk, chunks):
        # A row folds when a new token starts its chunk base + c >= B (then width == C).
        start = c * width
        folds_h = [n <= start < n + m and b + c >= blocks for n, m, b in zip(n_win_h, lengths_h, base_h)]
        if any(folds_h):
            lo = max(c - blocks, 0)  # rows that do not fold read a chunk they ignore
            new = _fold(
                sk, sv, radii, used, covered, ln_cur.detach(), kp_c[lo], vg_c[lo], gg_c[lo], (base + c) * chunk,
                config, norm_weight, norm_bias,
            )
            if all(folds_h):
                sk, sv, radii, used = new
                covered = covered + chunk
            else:
                folds = torch.tensor(folds_h, device=sk.device)
                sk = torch.where(folds[:, None, None, None], new[0], sk)
                sv = torch.where(folds[:, None, None, None], new[1], sv)
                radii = torch.where(folds[:, None, None], new[2], radii)
                used = torch.where(folds, new[3], used)
                covered = torch.where(folds, covered + chunk, covered)
            ln_cur = ln_s(sk, norm_weight, norm_bias)
        read_k.append(t_s * ln_cur)
        read_v.append(radii[..., None] * sv / sv.norm(dim=-1, keepdim=True).clamp_min(VALUE_EPS))
        read_live.append(row < used[:, None])

    # Attention for every chunk with a new query over [state snapshot ; window], laid out
    # [N, n_q, H, L, D] so that the cat below is the only copy and SDPA sees a view.
    n_q = chunks - first_chunk
    front = (reach - 1) * width  # window cells before grid cell 0, always masked

    def windows(x):  # [N, H, grid, D] -> [N, n_q, H, window, D], the window of every chunk
        return F.pad(x, (0, 0, front, 0)).unfold(2, window, width)[:, :, first_chunk:].permute(0, 2, 1, 4, 3)

    keys = torch.cat([torch.stack(read_k, 1), windows(t_w * kg)], dim=3)
    values = torch.cat([torch.stack(read_v, 1), windows(vg)], dim=3)
    queries = qg[:, :, first_chunk:].transpose(1, 2)  # [N, n_q, H, L, Dk]
    i = torch.arange(width, device=q.device)[:, None]
    w = torch.arange(window, device=q.device)
    cs = torch.arange(first_chunk, chunks, device=q.device)[:, None, None]
    win_mask = (w <= front + i) & (w >= front - cs * width)  # [n_q, L, window]: causal, inside the grid
    state_live = torch.stack(read_live, 1)  # [N, n_q, R]
    # Once every state row is live and the window lies inside the grid, every chunk has the
    # same mask, and SDPA is fastest with it broadcast; both conditions only ever turn on.
    steady = state_live.all(-1).all(0) & (cs[:, 0, 0] >= reach - 1)
    split = int((~steady).sum())

    # A call whose new tokens all sit in one chunk (decoding) needs only their query rows.
    q_lo, q_hi = 0, width
    if n_q == 1 and rows:
        q_lo = min(n_win_h) - first_chunk * width
        q_hi = max(max(n + m for n, m in zip(n_win_h, lengths_h)) - first_chunk * width, q_lo + 1)

    # The chunks before `split` and those after run as two SDPA calls; their inputs are cut by one
    # split per tensor (slicing would give each part a backward node that scatters into a
    # zero-filled gradient as large as all chunks' keys).
    sizes = [n for n in (split, n_q - split) if n]
    parts = zip(*(x.split(sizes, dim=1) for x in (queries, keys, values)))

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        count = query.shape[1]
        flat = [x.reshape((rows * count, heads) + tuple(x.shape[3:])) for x in (query, key, value)]
        if (q_lo, q_hi) != (0, width):
            flat[0], mask = flat[0][:, :, q_lo:q_hi], mask[..., q_lo:q_hi, :]
        o = F.scaled_dot_product_attention(*flat, attn_mask=mask)
        return F.pad(o, (0, 0, q_lo, width - q_hi)).view(rows, count, heads, width, dv)

    outputs = []
    if split:
        mask = torch.cat([
            state_live[:, :split, None, :].expand(-1, -1, width, -1),
            win_mask[:split].expand(rows, -1, -1, -1),
        ], dim=-1)  # [N, split, L, R + window]
        outputs.append(attend(*next(parts), mask.reshape(rows * split, 1, width, -1)))
    if split < n_q:
        mask = torch.zeros(1, 1, width, sk.shape[2] + window, dtype=q.dtype, device=q.device)
        mask[..., sk.shape[2] :].masked_fill_(~win_mask[-1], float("-inf"))
        outputs.append(attend(*next(parts), mask))
    o = torch.cat(outputs, dim=1).transpose(1, 2)
    o = F.pad(o, (0, 0, 0, 0, first_chunk, 0))  # [N, H, chunks, L, Dv]

    # The new window: the last seen - covered tokens, moved to the front of its W' slots.
    seen = state.seen + lengths
    shift = covered - state.covered
    room = state.window_k.shape[2]
    slots = torch.arange(room, device=q.device)
    index = (shift[:, None] + slots).clamp(max=grid - 1)  # [N, W']
    live = (slots < (seen - covered)[:, None]).to(kg.dtype)[:, None, :]

    def take(x):  # [N, H, grid, *] -> [N, H, W', *]
        rest = tuple(x.shape[3:])
        idx = index[:, None].expand((rows, heads, room)).reshape((rows, heads, room) + (1,) * len(rest))
        picked = x.gather(2, idx.expand((rows, heads, room) + rest))
        return picked * live.reshape((rows, 1, room) + (1,) * len(rest))

    final = KVMState(sk, sv, radii, used, take(kg), take(vg), take(gg), seen, covered)
    return from_chunks(o, flat_index, batch, length), final
