"""The single-token step of the torch backend: what decoding runs once per layer and token.

The loop body of the design page (section 1) for one token, arranged to launch few tensor
operations: on CPUs a decode step's cost is mostly per-operation overhead, not arithmetic on
the [H, M, D] memories. Both passes' compressions read their anchors (for ``identity``, the
current memories), which no write of this token changes before they are read, so one VJP call
serves the key and the value pass, and both writes come before the reads that follow them.
Same formulas as :mod:`.reference` (``tests/test_ops.py``).
"""

from __future__ import annotations

import torch

from .compress_mix import compress_residual_vjp, mix, reads_current_memory
from .state import TrellisState

# Up to this many entries in a memory (N H M D), eagerly on a CPU, the step's four memory
# products run as broadcast multiply-and-sum: a decode step took 0.3-6% less than with batched
# matmul up to 2^17 entries, 2.5-10% more from 393,216 up (BENCHMARKS.md, issue 73;
# benchmarks/bench_step_choices.py). Compiled, on GPUs and above it: matmul.
BROADCAST_PRODUCTS_MAX = 2**17


def step_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens,
                 consume_state=False):
    """One token per row (``T == 1``, no ``cu_seqlens``); arguments as validated by
    :func:`trellis_lm.ops.trellis_attention`: q, k ``[N, 1, H, Dk]``, v ``[N, 1, H, Dv]``,
    alpha ``[N, 1, H, M]``, log_beta and gamma ``[N, 1, H]``. Returns ``o [N, 1, H, Dv]`` and the state.
    ``consume_state`` (see :func:`~.dispatch.trellis_step`) is a permission this step does not
    take: its state after is new tensors."""
    m_k, m_v, a_k, a_v, offset = state.m_k, state.m_v, state.anchor_k, state.anchor_v, state.offset
    exact = write_gradient == "exact"
    # Eagerly on CPUs, replacing the anchors only at chunk starts saves two memory-sized copies per
    # step (reading the flag is no device sync there); on GPUs (where a sync would also stop a CUDA
    # graph's capture), and compiled, the select runs every step instead of branching on data.
    starts_chunk = None if exact else offset == 0
    if not exact and (q.device.type != "cpu" or torch.compiler.is_compiling() or bool(starts_chunk.any())):
        a_k = torch.where(starts_chunk[:, None, None, None], m_k, a_k)
        a_v = torch.where(starts_chunk[:, None, None, None], m_v, a_v)
    rows, _, heads, dk = q.shape
    dv, slots = v.shape[-1], alpha.shape[-1]
    # With one token per row, [N, 1, H, D] is [N, H, D] in the same memory: views, not selects,
    # give the column and row vectors ([N, H, D, 1], [N, H, 1, D]) each product wants.
    beta = log_beta.view(rows, heads, 1, 1).exp()
    # Exact writes and identity take their residual at the current memory, before this token's
    # write (section 1).
    r_k, r_v = (m_k, m_v) if reads_current_memory(compress_fn, write_gradient) else (a_k, a_v)
    broadcast = q.device.type == "cpu" and not torch.compiler.is_compiling() and m_k.numel() <= BROADCAST_PRODUCTS_MAX
    k, v = k.view(rows, heads, 1, dk), v.view(rows, heads, 1, dv)  # read, then written, with each
    gamma = gamma.view(rows, heads, 1)
    if broadcast and dk == dv:
        # Both passes as one: the memories as halves of one [2, N, H, M, D] tensor (as this branch
        # returns them), k and v as one [2, N, H, 1, D]; each product and write is then one
        # operation, not two.
        kv, memories = _paired(k, v), _paired(m_k, m_v)  # [2, N, H, 1, D], [2, N, H, M, D]
        reads = (kv * (memories if r_k is m_k else _paired(r_k, r_v))).sum(-1)  # [2, N, H, M]
        u = compress_residual_vjp(compress_fn, reads, alpha.view(rows, heads, slots)) * gamma
        m_k, m_v = torch.addcmul(beta * memories, u.unsqueeze(-1), kv, value=-1).unbind()
    else:
        if broadcast:
            reads = torch.stack([(k * r_k).sum(-1), (v * r_v).sum(-1)])  # [2, N, H, M]
        else:
            # Every memory read is a row vector times the memory's transpose ([N, H, 1, D] @ [.., D, M]):
            # torch's CPU batched matmul takes a matrix times a column vector several times slower
            # (BENCHMARKS.md, "Figures behind code comments").
            reads = torch.stack([k @ r_k.mT, v @ r_v.mT])  # [2, N, H, 1, M]
        u = compress_residual_vjp(compress_fn, reads.view(2, rows, heads, slots), alpha.view(rows, heads, slots))
        u_k, u_v = (u * gamma).view(2, rows, heads, slots, 1).unbind()
        m_k = torch.addcmul(beta * m_k, u_k, k, value=-1)
        m_v = torch.addcmul(beta * m_v, u_v, v, value=-1)
    q = q.view(rows, heads, 1, dk)
    if broadcast:
        h = mix(mix_fn, (q * m_k).sum(-1))  # [N, H, M]
        o = (h.view(rows, heads, slots, 1) * m_v).sum(-2)  # [N, H, Dv]
    else:
        o = mix(mix_fn, q @ m_k.mT) @ m_v  # [N, H, 1, M] @ [N, H, M, Dv]
    o = o.view(rows, 1, heads, dv)  # [N, H, (1,) Dv] and [N, 1, H, Dv] share their layout
    if exact:  # nothing reads the anchors: they follow the memories (section 3)
        # Compiled, as copies: aliased outputs would be the next compiled step's aliased inputs,
        # which dynamo guards on and compiles apart from the prefill's separate ones.
        a_k, a_v = (m_k.clone(), m_v.clone()) if torch.compiler.is_compiling() else (m_k, m_v)
    return o, TrellisState(m_k, m_v, a_k, a_v, (offset + 1) % chunk_size)


def _paired(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[2, *first.shape]`` holding ``first`` then ``second``: a view of the tensor both are views
    of when they have one layout and ``second`` lies after ``first`` in it (the memories this
    step returns, halves of one tensor; k and v, heads of one normalised projection), else the
    two stacked (a copy). Tensors that record gradients are stacked: autograd's ``as_strided``
    takes the view's geometry as its base's and gives views of views wrong gradients."""
    base = first._base
    if (base is not None and second._base is base and first.shape == second.shape and first.stride() == second.stride()
            and not (first.requires_grad or second.requires_grad)):
        gap = second.storage_offset() - first.storage_offset()
        if gap > 0:
            return first.as_strided((2, *first.shape), (gap, *first.stride()))
    return torch.stack([first, second])
