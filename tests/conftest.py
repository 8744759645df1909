"""Session set-up shared by every test module."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU only under the interpreter, and triton reads the switch when
    # it is first imported, which any test module (or a library it imports) may do first.
    os.environ.setdefault("TRITON_INTERPRET", "1")
