"""The JSON files of a checkpoint folder: one reader (`_json_object`) refuses
a file that is not JSON or not a JSON object, with the error class and the
words of its caller (`read_config`: CheckpointError; the generation config
and source files: ConfigError naming the file's role)."""

import re

import pytest

from blocklab._validate import ConfigError
from blocklab.interop import pretrained
from blocklab.training.checkpoint import CheckpointError


@pytest.mark.parametrize(
    "text, said", [("{not json", "is not JSON: "), ("[1, 2]", "is not a JSON object.")]
)
def test_read_config_refuses_a_bad_config_json(tmp_path, text, said):
    file = tmp_path / "config.json"
    file.write_text(text)
    with pytest.raises(CheckpointError) as info:
        pretrained.read_config(tmp_path)
    assert str(info.value).startswith(f"load_pretrained: {file} {said}")
    assert type(info.value) is CheckpointError


@pytest.mark.parametrize(
    "text, said", [("{not json", "is not JSON: "), ("3", "is not a JSON object.")]
)
def test_a_named_json_file_is_refused_by_its_role(tmp_path, text, said):
    file = tmp_path / "generation_config.json"
    file.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"own: source: {file} {said}")):
        pretrained._json_object("own", file, "source")


def test_a_json_object_is_read_as_it_stands(tmp_path):
    file = tmp_path / "config.json"
    file.write_text('{"model_type": "llama", "n": [1, 2]}')
    assert pretrained._json_object("own", file, "source") == {
        "model_type": "llama",
        "n": [1, 2],
    }
