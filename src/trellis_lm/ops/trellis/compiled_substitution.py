"""The forward substitution of ``"exact"`` writes as one compiled CPU kernel per chunk (backend
``"compiled"``).

A chunk's substitution (:func:`.chunked_autograd._substitute`) is a loop over its tokens on
M-vectors: eagerly, each token costs a few small operations, and at serving sizes their
dispatch, not their arithmetic, is about half of the op's time (BENCHMARKS.md, issue 75). Traced
with its token loop unrolled, every (pass, row, head) chain is independent, so inductor fuses
the whole chunk into one C++ loop over the chains. The function is the same (the sums of a
token's earlier terms are taken in another order: equal up to rounding).

Compiling costs about 35 s on a 2-core CPU for each compression function, dtype, pass count
and (M, D) (8 s when torch's compile cache already holds it); the number of (row, head)
pairs is a dynamic size, so batches of any size share one compilation. Only chunks of the
full layout width :data:`.chunked.EXACT_LAYOUT_CHUNK` run compiled (every chunk of a long
input: the grid's width is the longest chunk of any row); a call whose chunks are all shorter
(a prompt of a few tokens) runs the eager loop rather than compile for its width.
"""

from __future__ import annotations

import functools

import torch

from .compress_mix import compress_residual_vjp


def _unrolled(name: str, block: int, z: torch.Tensor, lower: torch.Tensor, alpha: torch.Tensor,
              u: torch.Tensor) -> None:
    """The substitution of :func:`.chunked_autograd._substitute` written for tracing, with its
    arguments (``z``, ``lower``, ``alpha``, ``u``, the same shapes) and its results in ``z`` and
    ``u``. A block's reads first take all earlier blocks' terms in one product (fewer traced
    operations: a shorter compile); inside a block each read sums its earlier tokens' terms."""
    width = z.shape[2]
    us, reads = [], []
    for lo in range(0, width, block):
        hi = min(width, lo + block)
        part = z[:, :, lo:hi]
        if lo:
            part = part - lower[:, :, lo:hi, :lo] @ torch.stack(us, dim=2)
        for r in range(lo, hi):
            read = part[:, :, r - lo]
            for i in range(lo, r):
                read = read - lower[:, :, r, i, None] * us[i]
            reads.append(read)
            us.append(compress_residual_vjp(name, read, alpha[:, r]))
    z.copy_(torch.stack(reads, dim=2))
    u.copy_(torch.stack(us, dim=2))


@functools.cache
def _compiled(name: str, block: int):
    return torch.compile(functools.partial(_unrolled, name, block), fullgraph=True)


def compiled_substitute(name: str, z: torch.Tensor, lower: torch.Tensor, alpha: torch.Tensor, u: torch.Tensor,
                        block: int) -> None:
    """:func:`.chunked_autograd._substitute` (same arguments: ``z [P, NH, L, M]`` in and out,
    ``lower [P, NH, L, L]``, ``alpha [NH, L, M]``, ``u [P, NH, L, M]`` out) as one compiled call,
    in blocks of ``block`` tokens. Inside another compiled function, traced into it as it is."""
    if torch.compiler.is_compiling():
        _unrolled(name, block, z, lower, alpha, u)
        return
    # Detached (views of the same memory, so z and u are still written): the compiled function
    # guards on requires_grad, and a training step's targets require it where inference's do not.
    args = [t.detach() for t in (z, lower, alpha, u)]
    # NH varies from call to call (rows of a batch, documents of a packed step): marked dynamic,
    # so that the first call compiles for every NH rather than for its own and then once again.
    for tensor, dim in zip(args, (1, 1, 0, 1)):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    _compiled(name, block)(*args)
