"""A checkpoint loads the way the Hub serves it: by repo id, from an offline Hugging Face cache,
in a virtual environment holding torch and transformers only (no triton, no trellis_lm).

Loaded by repo id, transformers runs its import check on every code file it fetches (a local
folder only gets the top file checked), so this is the test that sees a stray ``import triton``.
The environment is built once per pair of versions, under ``.venv-bare`` at the repository root,
with the torch and transformers versions of the running environment (so CI's lowest-version job
checks its own).
"""

from __future__ import annotations

import os
import subprocess
import venv
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import AutoTokenizer

from bare_torch import install_running_torch
from tiny_models import tiny_model
from trellis_lm import TrellisForCausalLM, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
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


def _bare_python() -> Path:
    """``.venv-bare/bin/python`` with this environment's torch and transformers and their
    dependencies only; built on first use (pip resolves transformers' own requirements)."""
    wanted = [f"torch=={version('torch').split('+')[0]}", f"transformers=={version('transformers')}"]
    env_dir = ROOT / ".venv-bare" / "-".join(wanted).replace("==", "-")
    python = env_dir / "bin" / "python"
    stamp = env_dir / "installed"
    env_dir.parent.mkdir(exist_ok=True)
    with FileLock(env_dir.parent / f"{env_dir.name}.lock"):  # pytest-xdist workers build it once
        if not stamp.is_file():
            venv.create(env_dir, with_pip=True, clear=True)
            # torch first and alone: resolved with transformers, pip could pick another build.
            install_running_torch(python)
            subprocess.run([str(python), "-m", "pip", "install", "-q", wanted[1]], check=True, timeout=1200)
            # PyPI's Linux torch (the CUDA build) pulls triton, which this test must not see: the
            # machines it stands for (macOS, CPU builds) have none, and torch imports without it.
            subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "triton"], check=True, timeout=600)
            stamp.touch()
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
def test_hub_checkpoint_loads_by_repo_id_with_torch_and_transformers_only(tmp_path, schedule):
    python = _bare_python()
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
