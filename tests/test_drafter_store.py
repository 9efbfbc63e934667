"""Drafters in the model store: `pie model import SOURCE --drafter NAME` converts the MTP layers
inside SOURCE, or copies a head folder (a path, a trained head's name, a shipped head's name),
into models/<model>/drafters/<name>/ in the model's dtype; attaching to an imported model works in
place; detach and remove; an incompatible head is a clear error that leaves the store unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from host import cli, paths, store
from host.drafter import layouts
from host.drafter.mtp import WEIGHTS_FILE, MtpHead, load_head
from host.errors import ImportFailed, InvalidArgument

V, H = 64, 32


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "pie"))
    monkeypatch.setattr(store, "SHIPPED_DRAFTERS", tmp_path / "shipped")  # never the repo's heads
    return tmp_path / "pie"


def tiny_model(hidden: int = H):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)).eval()


def make_source(folder, mtp: bool):
    """A tiny Llama folder with a tokenizer; with mtp, DeepSeek-style MTP layers in its safetensors."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model()
    model.save_pretrained(folder)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2").save_pretrained(folder)
    if mtp:
        state = load_file(str(folder / "model.safetensors"))
        g = torch.Generator().manual_seed(5)
        p = "model.layers.1."  # num_hidden_layers = 1: the first MTP layer
        for k, v in model.model.layers[0].state_dict().items():
            state[p + k] = torch.randn(v.shape, generator=g) * 0.1
        for k, shape in {"enorm.weight": [H], "hnorm.weight": [H], "eh_proj.weight": [H, 2 * H],
                         "shared_head.norm.weight": [H]}.items():
            state[p + k] = torch.randn(shape, generator=g) * 0.1
        state[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        state[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    return folder


def make_head(folder, hidden: int = H, draft_vocab=None):
    target = tiny_model(hidden)
    torch.manual_seed(7)
    head = MtpHead(target, draft_vocab=draft_vocab)
    head.save(folder, head.spec(folder.name, source="trained", recipe={"steps": 1}))
    return folder


def entry(home, name="tiny"):
    return home / "models" / name


def snapshot(home):
    """Every path under the store, with file sizes: what 'unchanged' means."""
    return sorted((str(p.relative_to(home)), p.stat().st_size if p.is_file() else -1) for p in home.rglob("*"))


def test_import_with_mtp_and_a_head_folder(home, tmp_path, capsys):
    src = make_source(tmp_path / "tiny", mtp=True)
    head_dir = make_head(tmp_path / "heads" / "myhead", draft_vocab=[3, 5, 7])
    rec, created = store.import_model(str(src), dtype="float32", drafter=["mtp", str(head_dir)], progress=False)
    assert created and rec.drafters == ["mtp", "myhead"]
    assert sorted(p.name for p in (entry(home) / "drafters").iterdir()) == ["mtp", "myhead"]
    assert json.loads((entry(home) / "pie.json").read_text())["drafters"] == ["mtp", "myhead"]

    target = tiny_model()
    # the MTP layers, converted: the same head read from the source directly
    mtp, spec = load_head(store.drafter_path(rec, "mtp"), target)
    assert spec.source.startswith("mtp:deepseek ") and not spec.own_head  # shared_head.head is the lm_head
    direct, _ = layouts.read_mtp_head(src, target)
    for k, v in direct.state_dict().items():
        torch.testing.assert_close(mtp.state_dict()[k], v, atol=0, rtol=0)
    # the head folder, copied under its folder's name, draft vocabulary and recipe kept
    mine, spec = load_head(store.drafter_path(rec, "myhead"), target)
    assert spec.name == "myhead" and spec.source == "trained" and spec.recipe == {"steps": 1}
    assert mine.draft_vocab.tolist() == [3, 5, 7]
    with pytest.raises(InvalidArgument, match="has no drafter 'nope'"):
        store.drafter_path(rec, "nope")

    assert cli.main(["model", "list"]) == 0
    assert "mtp,myhead" in capsys.readouterr().out
    # the same import again is a no-op, in any order
    again, created = store.import_model(str(src), dtype="float32", drafter=[str(head_dir), "mtp"],
                                        progress=False)
    assert not created and again.drafters == ["mtp", "myhead"]


def test_attach_in_place_list_detach_remove(home, tmp_path, capsys):
    src = make_source(tmp_path / "tiny", mtp=True)
    assert cli.main(["model", "import", str(src), "--dtype", "bfloat16"]) == 0
    assert store.read_record("tiny").drafters == []
    weights = (entry(home) / "model.safetensors").stat().st_mtime_ns

    # attach the MTP layers to the imported model; the model itself is not rewritten
    assert cli.main(["model", "import", str(src), "--drafter", "mtp"]) == 0
    assert "imported: tiny" in capsys.readouterr().out
    assert store.read_record("tiny").drafters == ["mtp"]
    assert (entry(home) / "model.safetensors").stat().st_mtime_ns == weights
    from safetensors import safe_open

    with safe_open(str(entry(home) / "drafters" / "mtp" / WEIGHTS_FILE), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # the model's dtype
    # idempotent
    assert cli.main(["model", "import", str(src), "--drafter", "mtp"]) == 0
    assert "already imported" in capsys.readouterr().out

    # a trained head by name ($PIE_HOME/drafters/<name>) and a shipped one, in one import
    make_head(paths.drafters_dir() / "trained1")
    make_head(tmp_path / "shipped" / "shipped1")
    assert store.available_drafters() == ["shipped1", "trained1"]
    assert cli.main(["model", "import", str(src), "--drafter", "trained1", "--drafter", "shipped1"]) == 0
    assert store.read_record("tiny").drafters == ["mtp", "trained1", "shipped1"]
    capsys.readouterr()
    assert cli.main(["model", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["drafters"] == ["mtp", "trained1", "shipped1"]
    assert not [p for p in (entry(home) / "drafters").iterdir() if p.name.startswith(".")]

    # detach one
    assert cli.main(["model", "remove", "tiny", "--drafter", "trained1"]) == 0
    assert "removed drafter trained1 from tiny" in capsys.readouterr().out
    assert store.read_record("tiny").drafters == ["mtp", "shipped1"]
    assert not (entry(home) / "drafters" / "trained1").exists()
    assert cli.main(["model", "remove", "tiny", "--drafter", "trained1"]) == 2
    assert "has no drafter 'trained1'" in capsys.readouterr().err
    # remove the whole entry, drafters included
    assert cli.main(["model", "remove", "tiny"]) == 0
    assert list((home / "models").iterdir()) == []


def test_errors_leave_the_store_unchanged(home, tmp_path, capsys):
    plain = make_source(tmp_path / "plain", mtp=False)
    bad_head = make_head(tmp_path / "wide", hidden=48)
    not_head = tmp_path / "empty-head"
    not_head.mkdir()

    # fresh imports: nothing written
    with pytest.raises(InvalidArgument, match="has no MTP layers"):
        store.import_model(str(plain), dtype="float32", drafter="mtp", progress=False)
    with pytest.raises(InvalidArgument, match="hidden size 48, the model 32"):
        store.import_model(str(plain), dtype="float32", drafter=str(bad_head), progress=False)
    with pytest.raises(InvalidArgument, match="not a head folder"):
        store.import_model(str(plain), dtype="float32", drafter=str(not_head), progress=False)
    with pytest.raises(InvalidArgument, match="unknown drafter 'nothing-here'"):
        store.import_model(str(plain), dtype="float32", drafter="nothing-here", progress=False)
    assert not (home / "models").exists() or list((home / "models").iterdir()) == []

    # attaching to an imported model: the entry is unchanged
    store.import_model(str(plain), dtype="float32", progress=False)
    before = snapshot(home)
    with pytest.raises(InvalidArgument, match="hidden size 48"):
        store.import_model(str(plain), dtype="float32", drafter=str(bad_head), progress=False)
    good = make_head(tmp_path / "good")
    with pytest.raises(InvalidArgument, match="hidden size 48"):  # all or nothing
        store.import_model(str(plain), dtype="float32", drafter=[str(good), str(bad_head)], progress=False)
    with pytest.raises(InvalidArgument, match="has no MTP layers"):
        store.import_model(str(plain), drafter="mtp", progress=False)
    capsys.readouterr()
    assert cli.main(["model", "import", str(plain), "--drafter", str(bad_head)]) == 2
    # (transformers' own loading bar may come first)
    assert capsys.readouterr().err.splitlines()[-1].startswith("pie: error: drafter 'wide' has hidden size 48")
    assert snapshot(home) == before and store.read_record("plain").drafters == []
    # another dtype is still a different model, drafter or not
    with pytest.raises(ImportFailed, match="different model"):
        store.import_model(str(plain), dtype="bfloat16", drafter=str(good), progress=False)
