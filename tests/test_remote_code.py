"""Checkpoints carry flat copies of the code and load with trust_remote_code=True alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers.dynamic_module_utils import get_imports, get_relative_imports

from tiny_models import SCHEDULES, left_pad, random_tokens, tiny_model
from trellis_lm import TrellisConfig, TrellisForCausalLM, train_tokenizer
from trellis_lm.layer_kinds import layer_signature
from trellis_lm.mixers import DEFAULT_KIND, MIXERS
from trellis_lm.model_card_trellis import MARKER, TrainingRun, config_fields, render_model_card
from trellis_lm.remote_code import AUTO_MAP, export_code, flat_name, flat_sources, flatten_imports, without_imports


@pytest.mark.parametrize(
    "module, expected",
    [("ops", "trellis_ops"), ("ops.trellis.dispatch", "trellis_ops_trellis_dispatch"),
     ("cache_trellis", "cache_trellis"), ("mixers.base", "trellis_mixers_base")],
)
def test_flat_names(module, expected):
    assert flat_name(module) == expected


def test_flatten_rewrites_only_relative_import_lines():
    source = textwrap.dedent(
        """\
        from __future__ import annotations
        import torch
        from .ops import trellis_attention
        from .ops.state import OpState
        from .cache_trellis import TrellisCache
        if True:
            from .ops.trellis.compress_mix import (
                mix,
            )
        text = "from .ops import x"
        """
    )
    flat = flatten_imports(source, package="")
    assert flat == source.replace("from .ops import trellis", "from .trellis_ops import trellis").replace(
        "from .ops.state", "from .trellis_ops_state"
    ).replace("    from .ops.trellis.compress_mix", "    from .trellis_ops_trellis_compress_mix")
    # Inside a sub-package, one dot is a sibling and two climb to the parent.
    assert (flatten_imports("from .compress_mix import mix\n", "ops.trellis")
            == "from .trellis_ops_trellis_compress_mix import mix\n")
    assert flatten_imports("from ..checks import x\n", "ops.trellis") == "from .trellis_ops_checks import x\n"
    assert flatten_imports("from ...cache_trellis import x\n", "ops.trellis") == "from .cache_trellis import x\n"


@pytest.mark.parametrize(
    "line, package",
    [("from . import ops\n", ""), ("from ..ops import x\n", ""), ("from ....x import y\n", "ops.trellis")],
)
def test_flatten_refuses_what_a_flat_folder_cannot_hold(line, package):
    with pytest.raises(ValueError, match="cannot flatten"):
        flatten_imports(line, package)


def assert_self_contained(folder, written) -> None:
    for path in written:
        # Read the way transformers' loader reads them: every relative import is a sibling file...
        for module in get_relative_imports(path):
            assert (folder / f"{module}.py").is_file(), f"{path.name} imports missing .{module}"
        # ...and no absolute import needs this package.
        assert not any(name.startswith("trellis_lm") for name in get_imports(path)), path.name
    for auto_class, reference in AUTO_MAP.items():
        assert (folder / f"{reference.split('.')[0]}.py").is_file(), auto_class


def test_exported_code_is_self_contained(tmp_path):
    written = export_code(tmp_path)
    names = {p.name for p in written}
    assert {"configuration_trellis.py", "modeling_trellis.py", "cache_trellis.py", "trellis_ops_trellis_dispatch.py",
            "trellis_ops_state.py", "trellis_mixers_attention.py", "trellis_ops_trellis_triton_chunk.py",
            "trellis_ops_trellis_triton_step.py"} <= names
    # Only what a model runs: not the CLI, training, evaluation or conversion code, nor the
    # package of every op (each mixer imports its own op).
    assert not any(part in name for name in names for part in ("cli", "training", "eval", "conversion", "mirror"))
    assert "trellis_ops.py" not in names
    assert names == set(flat_sources())
    assert_self_contained(tmp_path, written)


# The package's layer kinds and the flat files of their code (mixers/<kind>.py, ops/<kind>/).
PACKAGE_KINDS = ("trellis", "lattice", "kvm", "attention")


def kind_files(names: set[str], kind: str) -> set[str]:
    return {name for name in names if name.startswith((f"trellis_mixers_{kind}.", f"trellis_ops_{kind}"))}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_checkpoint_carries_the_code_of_its_own_layer_kinds_only(tmp_path, schedule):
    model = tiny_model(schedule=schedule)
    model.save_pretrained(tmp_path)
    names = {p.name for p in tmp_path.glob("*.py")}
    # The default kind's code too: transformers < 5.11 makes a config without arguments (its
    # layers of that kind) whenever it prints or saves one.
    kinds = {*model.config.layer_kinds, DEFAULT_KIND}
    for kind in PACKAGE_KINDS:
        assert bool(kind_files(names, kind)) == (kind in kinds), (kind, sorted(names))
    # A GPU user of a Trellis checkpoint runs its Triton kernels.
    assert {"trellis_ops_trellis_triton_chunk.py", "trellis_ops_trellis_triton_step.py"} <= names or "trellis" not in kinds
    assert_self_contained(tmp_path, list(tmp_path.glob("*.py")))
    # The mixers' package keeps the import lines of the model's kinds, and nothing of the others.
    registry = (tmp_path / "trellis_mixers.py").read_text()
    for kind in PACKAGE_KINDS:
        assert (f"from .trellis_mixers_{kind} import" in registry) == (kind in kinds)
    all_trellis = len(flat_sources(["trellis"]))
    assert all_trellis < len(flat_sources()) - 10  # not the 46 files every checkpoint carried before
    assert f"{all_trellis} files for an all-Trellis model" in (Path(__file__).parents[1] / "README.md").read_text()


def test_only_package_inits_may_import_every_kind():
    assert without_imports("from .kvm import KVMMixer\nfrom .base import Mixer\n", "mixers",
                           lambda module: module == "mixers.kvm") == "from .base import Mixer\n"
    with pytest.raises(ValueError, match="on one line"):
        without_imports("from .kvm import (\n    KVMMixer,\n)\n", "mixers", lambda module: module == "mixers.kvm")


def test_every_config_field_is_model_level_or_a_layer_kinds():
    """What the card's field list rests on: a field is used by every model or by its kind's layers."""
    kind_fields = {field.name for mixer in MIXERS.values() for field in mixer.config_fields}
    model_level = set(TrellisConfig.model_level_fields)
    assert set(config_fields(TrellisConfig())) == model_level | kind_fields
    assert not model_level & kind_fields


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_card_lists_the_fields_its_layers_use(tmp_path, schedule):
    model = tiny_model(schedule=schedule)
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \| `", card, flags=re.MULTILINE))
    config = model.config
    assert listed == set(config.model_level_fields) | (set(layer_signature(config)) & set(config_fields(config)))
    kinds = set(config.layer_kinds)
    assert any(name.startswith("kvm_") for name in listed) == ("kvm" in kinds)
    assert ("lattice_variant" in listed) == ("lattice" in kinds)
    assert ("compress_fn" in listed) == ("trellis" in kinds)
    assert ("num_key_value_heads" in listed) == ("attention" in kinds)


def test_the_card_has_the_sections_a_hub_card_needs():
    config = tiny_model().config
    bare = render_model_card(config, "someone/model", 12345)
    run = TrainingRun(recipe="trellis_lm.training.pretrain", data="Local files: corpus.txt", steps=60,
                      settings={"learning rate": "0.003 (cosine)"}, final_loss=2.5)
    trained = render_model_card(config, "someone/model", 12345, training=run)
    for card in (bare, trained):
        headings = re.findall(r"^## (.+)$", card, flags=re.MULTILINE)
        assert {"Usage", "Intended use", "Limitations", "License", "Training data", "Evaluation", "Configuration",
                "Generation defaults"} <= set(headings), headings
        assert "pip install trellis-lm" not in card and "python -m build" in card
    assert "Not recorded" in bare and "Not recorded" not in trained
    assert "Local files: corpus.txt. Trained by `trellis_lm.training.pretrain`: 60 steps; learning rate 0.003 (cosine)" in trained
    assert "last logged training loss was 2.500 (perplexity 12.2" in trained


REMOTE_SCRIPT = """
import importlib.abc, sys
from pathlib import Path

class RefuseTrellisLm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "trellis_lm" or name.startswith("trellis_lm."):
            raise ImportError(f"{name} is hidden in this process")
        return None

sys.meta_path.insert(0, RefuseTrellisLm())
sys.modules["triton"] = None  # as on a machine without triton (the CPU install)
try:
    import trellis_lm
except ImportError:
    pass
else:
    raise SystemExit("trellis_lm should not be importable here")

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

checkpoint, resaved = Path(sys.argv[1]), Path(sys.argv[2])
config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
assert type(config).__module__.startswith("transformers_modules"), type(config).__module__
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
inputs = torch.load(checkpoint / "inputs.pt")
out = {"logits": model(**inputs).logits}
out["generated"] = model.generate(**inputs, max_new_tokens=5, do_sample=False)
out["beams"] = model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
prompt = tokenizer(["hello world", "hi"], padding=True, return_tensors="pt")
out["from_text"] = model.generate(**prompt, max_new_tokens=3, do_sample=False)
out["generation_config"] = model.generation_config.to_diff_dict()
model.save_pretrained(resaved)
torch.save(out, checkpoint / "remote_outputs.pt")
assert not any(name.startswith("trellis_lm") for name in sys.modules)
"""


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_checkpoint_loads_as_remote_code_without_the_package(tmp_path, schedule):
    model = tiny_model(seed=3, vocab_size=300, schedule=schedule)  # a byte-level tokenizer needs 259 ids at least
    model.generation_config.max_new_tokens = 7  # a saved generation default travels with the checkpoint
    checkpoint, resaved = tmp_path / "checkpoint", tmp_path / "resaved"
    model.save_pretrained(checkpoint)
    tokenizer = train_tokenizer(["hello world", "hi there", "hello there world"] * 5, vocab_size=model.config.vocab_size)
    tokenizer.save_pretrained(checkpoint)
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"] == AUTO_MAP
    card = (checkpoint / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and MARKER in card
    assert 'from_pretrained("checkpoint", trust_remote_code=True)' in card
    slots = any(kind in ("trellis", "lattice") for kind in model.config.layer_kinds)  # the kinds with slots
    assert ("| `num_slots` | `6` |" in card) == slots and ("| `chunk_size` | `4` |" in card) == slots
    assert '"max_new_tokens": 7' in card
    ids, mask = left_pad([random_tokens(1, 7)[0], random_tokens(1, 4, seed=1)[0]])
    torch.save({"input_ids": ids, "attention_mask": mask}, checkpoint / "inputs.pt")

    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(checkpoint), str(resaved)], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    remote = torch.load(checkpoint / "remote_outputs.pt")
    torch.testing.assert_close(remote["logits"], model(ids, attention_mask=mask).logits, rtol=0, atol=0)
    assert torch.equal(remote["generated"], model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    assert torch.equal(remote["beams"], model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2))
    prompt = tokenizer(["hello world", "hi"], padding=True, return_tensors="pt")
    assert torch.equal(remote["from_text"], model.generate(**prompt, max_new_tokens=3, do_sample=False))
    assert {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 7}.items() <= remote[
        "generation_config"].items()

    # What the remote-code process saved is a complete checkpoint again.
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert {p.name for p in resaved.glob("*.py")} == {p.name for p in checkpoint.glob("*.py")} - {"tokenization_trellis.py"}
    assert {"modeling_trellis.py", "model_card_trellis.py", f"trellis_mixers_{model.config.layer_kinds[0]}.py"} <= {
        p.name for p in resaved.glob("*.py")}
    assert (resaved / "README.md").read_text().replace("resaved", "checkpoint") == card
    reloaded = TrellisForCausalLM.from_pretrained(resaved)
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


class FakeHub(dict):
    """Repo id -> names of the files an upload sent; ``cards`` holds the uploaded README.md
    texts and ``existing_cards`` the cards repositories hold before the upload."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, str] = {}
        self.existing_cards: dict[str, str] = {}


@pytest.fixture
def uploads(monkeypatch) -> FakeHub:
    """Stand-ins for the Hub, recording what uploads would send."""
    import huggingface_hub
    import transformers.configuration_utils as configuration_utils
    import transformers.modeling_utils as modeling_utils
    import transformers.utils.hub as hub
    from huggingface_hub.errors import EntryNotFoundError

    sent = FakeHub()

    def fake_create_repo(self, repo_id, **kwargs):
        return type("Repo", (), {"repo_id": repo_id})()

    class FakeCard:
        def save(self, path):
            pass

    def record(repo_id, folder, changed):
        sent[repo_id] = {f for f in os.listdir(folder) if changed(f)}
        if "README.md" in sent[repo_id]:
            sent.cards[repo_id] = open(os.path.join(folder, "README.md"), encoding="utf-8").read()

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):  # the model's push (public API)
        record(repo_id, folder_path, lambda f: True)

    def fake_upload_modified(self, working_dir, repo_id, files_timestamps, **kwargs):  # transformers' own (the config's)
        record(repo_id, working_dir, lambda f: f not in files_timestamps
               or os.path.getmtime(os.path.join(working_dir, f)) > files_timestamps[f])

    def fake_card_load(repo_id, **kwargs):
        if repo_id not in sent.existing_cards:
            raise EntryNotFoundError(f"{repo_id} has no README.md")
        return huggingface_hub.ModelCard(sent.existing_cards[repo_id])

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    for module in (hub, modeling_utils, configuration_utils):
        monkeypatch.setattr(module, "hf_api", lambda: huggingface_hub.HfApi())
    for module in (hub, modeling_utils):
        monkeypatch.setattr(module, "create_and_tag_model_card", lambda *args, **kwargs: FakeCard())
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", fake_upload_modified)
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", staticmethod(fake_card_load))
    return sent


CODE = {"modeling_trellis.py", "configuration_trellis.py", "model_card_trellis.py", "trellis_ops_trellis_triton_chunk.py",
        "trellis_ops_trellis_dispatch.py", "trellis_mixers_trellis.py"}


def test_push_to_hub_uploads_the_code_and_the_model_card(uploads, tmp_path):
    model = tiny_model()
    model.push_to_hub("someone/pushed", tags=["my-tag"])
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="someone/saved")
    model.config.save_pretrained(tmp_path / "config", push_to_hub=True, repo_id="someone/config")
    for repo in ("someone/pushed", "someone/saved"):
        assert CODE | {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= uploads[repo]
        # The card is the model's own, with the repository in its usage example.
        assert MARKER in uploads.cards[repo] and f'from_pretrained("{repo}", trust_remote_code=True)' in uploads.cards[repo]
    assert "- my-tag" in uploads.cards["someone/pushed"]
    assert CODE | {"config.json"} <= uploads["someone/config"]


def test_push_to_hub_keeps_a_hand_written_card(uploads):
    uploads.existing_cards["someone/written"] = "---\nlicense: mit\n---\n# A card someone wrote\n"
    tiny_model().push_to_hub("someone/written")
    assert "model.safetensors" in uploads["someone/written"] and "README.md" not in uploads["someone/written"]


def test_save_pretrained_keeps_a_hand_written_card(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert MARKER in (tmp_path / "README.md").read_text()  # a generated card is refreshed on every save
    (tmp_path / "README.md").write_text("# Mine\n")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# Mine\n"


@pytest.mark.parametrize("schedule", ["trellis", "kvm-hybrid"])
def test_the_card_describes_each_layer_by_its_mixers_declaration(tmp_path, schedule):
    model = tiny_model(schedule=schedule, head_dim=6)
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    kinds = model.config.layer_kinds
    for kind in set(kinds):
        mixer = MIXERS[kind]
        assert mixer.display_name in card and mixer.describe_cache(model.config) in card
    # KVM keeps a window and means, not slots; a memory-only model decodes at a constant cost.
    assert ("x 6 slots" in card) == any(kind in ("trellis", "lattice") for kind in kinds)
    assert ("window of the last 3 tokens" in card) == ("kvm" in kinds)
    assert ("same time and memory per token" in card) == ("attention" not in kinds)
