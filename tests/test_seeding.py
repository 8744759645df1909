"""tests/conftest.py seeds every test from its node id: a draw without a generator of its own is
the one the id gives, whichever tests ran before it in the process."""

from __future__ import annotations

import random
import zlib

import pytest
import torch


@pytest.mark.parametrize("case", ["one", "another"])
def test_a_tests_draws_follow_from_its_node_id_alone(request, case):
    seed = zlib.crc32(request.node.nodeid.encode())
    assert torch.equal(torch.randn(4), torch.randn(4, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()
    torch.manual_seed(0)  # what a test may leave behind: the next test's draws do not see it
