"""A checkpoint loads the way the Hub serves it: by repo id, from an offline Hugging Face cache,
in a virtual environment holding torch and transformers only (no triton, no trellis_lm).

Loaded by repo id, transformers runs its import check on every code file it fetches (a local
folder only gets the top file checked), so this is the test that sees a stray ``import triton``.
The environment links the running environment's torch and transformers (so CI's lowest-version
job checks its own), once per test session.
"""

from __future__ import annotations

import os
import subprocess
import venv
from importlib.metadata import Distribution, distribution
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from transformers import AutoTokenizer

from tiny_models import tiny_model
from trellis_lm import TrellisForCausalLM, train_tokenizer

REPO_ID = "trellis-test/every-mixer"
REVISION = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["hello world", "hi"]

LOAD_BY_REPO_ID = """
import importlib.util, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

for name in ("triton", "trellis_lm", "peft", "accelerate"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed in the bare environment"
repo_id, prompts, out_path = sys.argv[1], sys.argv[2].split("|"), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
prompt = tokenizer(prompts, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**prompt).logits
generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
torch.save({"input_ids": prompt["input_ids"], "logits": logits, "generated": generated}, out_path)
"""


# PyPI's Linux torch (the CUDA build) requires triton, which this test must not see: the machines
# it stands for (macOS, CPU builds) have none, and torch imports without it.
LEFT_OUT = {"triton"}


def _closure(names: list[str]) -> list[Distribution]:
    """The installed distributions ``names`` need: theirs and their requirements', recursively,
    where this platform's markers ask for them (no extras), less ``LEFT_OUT``."""
    found: dict[str, Distribution] = {}
    wanted = list(names)
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in found or name in LEFT_OUT:
            continue
        found[name] = distribution(name)
        for line in found[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    return list(found.values())


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory) -> Path:
    """The ``python`` of a venv holding this environment's torch and transformers and what they
    need, nothing else: the very builds (links to their installed files, so nothing is
    downloaded or copied, and CI's lowest-version job checks its own versions)."""
    env_dir = tmp_path_factory.mktemp("bare") / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in _closure(["torch", "transformers"]):
        for top in {Path(file).parts[0] for file in dist.files or []} - {".."}:  # "..": scripts
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    return python


def _offline_hub_snapshot(hub_cache: Path) -> Path:
    """The folder a repo id resolves to offline: ``models--org--name/snapshots/<sha>`` with
    ``refs/main`` naming the sha, as huggingface_hub lays out its cache."""
    repo_dir = hub_cache / f"models--{REPO_ID.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    return repo_dir / "snapshots" / REVISION


# Every mixer kind in one model, and each memory kind alone: a checkpoint carries only its own
# kinds' code (remote_code), so each must load from what it carries.
@pytest.mark.parametrize("schedule", ["kvm-hybrid", "trellis", "lattice", "kvm"])
def test_hub_checkpoint_loads_by_repo_id_with_torch_and_transformers_only(tmp_path, schedule, bare_python):
    python = bare_python
    hub_cache = tmp_path / "hub"
    snapshot = _offline_hub_snapshot(hub_cache)
    model = tiny_model(seed=5, vocab_size=300, schedule=schedule)
    model.save_pretrained(snapshot)
    train_tokenizer(["hello world", "hi there", "hello there world"] * 5, vocab_size=300).save_pretrained(snapshot)

    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV", "HF_"))
    } | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "HF_HOME": str(tmp_path / "hf-home")}
    out_path = tmp_path / "remote.pt"
    run = subprocess.run(
        [str(python), "-c", LOAD_BY_REPO_ID, REPO_ID, "|".join(PROMPTS), str(out_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # The code really came through the Hub path: copied into the modules cache under the repo id.
    copied = {path.name for path in (tmp_path / "hf-home" / "modules" / "transformers_modules").rglob("*.py")}
    assert {"modeling_trellis.py", f"trellis_mixers_{model.config.layer_kinds[0]}.py"} <= copied
    # Trellis's Triton kernels travel with every checkpoint (Trellis is the default kind, whose
    # code every checkpoint carries), and load without triton.
    assert "trellis_ops_trellis_triton_chunk.py" in copied

    remote = torch.load(out_path)
    local = TrellisForCausalLM.from_pretrained(snapshot)
    prompt = AutoTokenizer.from_pretrained(snapshot)(PROMPTS, padding=True, return_tensors="pt")
    assert torch.equal(remote["input_ids"], prompt["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], local(**prompt).logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(remote["generated"], local.generate(**prompt, max_new_tokens=6, do_sample=False))
