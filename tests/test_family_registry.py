"""The one family registry: a family is one file in `interop/families/`.

Decoders and encoders are one `Family` type in one `FAMILIES`; the package
`blocklab.interop.families` imports every module in its folder, so a new
family is a file dropped there and nothing else (the scratch test below
copies the package, adds one file and loads a folder of the new family);
a class has one family (a second registration for it is refused by name);
the modules that moved there are gone from their old paths.
"""

import importlib
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.interop import FAMILIES, register_family
from blocklab.interop.hf_common import Family, Rule, decoder_families

#: The family modules, one file each in `interop/families/`.
MODULES = (
    "bert", "gemma2", "gemma3", "gpt2", "llama", "mistral", "mixtral",
    "modernbert", "olmo2", "phi3", "qwen2", "qwen3", "t5", "vit", "whisper",
)  # fmt: skip

#: The new family: Llama's layout under another class name and model_type,
#: with its own list of understood config fields.
SCRATCH_FAMILY = '''\
"""A scratch family: Llama's state-dict layout as `ScratchLMForCausalLM`."""

from ...models.decoder_config import DecoderConfig
from ..hf_common import llama_like, register_llama_layout, understood
from .llama import FIELDS as LLAMA_FIELDS
from .llama import llama_fields, llama_layer

CLS = "ScratchLMForCausalLM"
FIELDS = {k: v for k, v in LLAMA_FIELDS.items() if k != "head_dim"}


def scratch_config(hf, cls=None):
    hf = understood(CLS, hf, FIELDS)
    return llama_like(hf, CLS, DecoderConfig.llama)


def scratch_fields(cfg):
    fields = llama_fields(cfg)
    del fields["head_dim"]
    return fields


SCRATCH = register_llama_layout(
    "scratch", CLS, scratch_config, scratch_fields, llama_layer, FIELDS,
    model_types=("scratch_lm",),
)
'''

#: Run in a child process whose `blocklab` is the copy with the new file.
CHILD = """
import json, pathlib, tempfile
import jax, numpy as np
import blocklab
from blocklab._validate import ConfigError
from blocklab.interop import FAMILIES, load_pretrained, save_pretrained
from blocklab.models import DecoderConfig, DecoderLM

assert pathlib.Path(blocklab.__file__).is_relative_to(ROOT), blocklab.__file__
assert FAMILIES["scratch"].classes == ("ScratchLMForCausalLM",)
cfg = DecoderConfig.llama(61, 32, 4, 2, num_kv_heads=2, ffn_width=48, max_len=16)
model = DecoderLM(cfg, key=jax.random.key(0))
ids = np.arange(12) % 61
want = np.asarray(model(ids))
tmp = pathlib.Path(tempfile.mkdtemp())

# a Llama folder, renamed to the new family: loaded by its config.json alone
folder = save_pretrained(model, tmp / "llama", family="llama")
raw = json.loads((folder / "config.json").read_text())
raw.update(architectures=["ScratchLMForCausalLM"], model_type="scratch_lm")
raw.pop("head_dim")
(folder / "config.json").write_text(json.dumps(raw))
got = np.asarray(load_pretrained(folder)(ids))
np.testing.assert_array_equal(got, want)

# the way back: the new family writes its own class and model_type
out = save_pretrained(model, tmp / "scratch", family="scratch")
raw = json.loads((out / "config.json").read_text())
assert raw["architectures"] == ["ScratchLMForCausalLM"], raw["architectures"]
assert raw["model_type"] == "scratch_lm", raw["model_type"]
np.testing.assert_array_equal(np.asarray(load_pretrained(out)(ids)), want)

# its own list of understood fields: head_dim is not on it
raw["head_dim"] = 8
(out / "config.json").write_text(json.dumps(raw))
try:
    load_pretrained(out)
except ConfigError as err:
    assert "ScratchLMForCausalLM config field head_dim=8" in str(err), err
else:
    raise AssertionError("head_dim was not refused")
print("loaded")
"""


def test_a_new_family_is_one_file(tmp_path):
    """Copy the package, write one module into `interop/families/`, edit
    nothing else: `load_pretrained` reads a folder of the new family (its
    logits are the original model's, exactly: the same weights), and
    `save_pretrained` writes one, and the family refuses the fields it does
    not list."""
    import blocklab

    src = tmp_path / "blocklab"
    shutil.copytree(
        blocklab.__path__[0], src, ignore=shutil.ignore_patterns("__pycache__")
    )
    target = src / "interop" / "families" / "scratch.py"
    assert not target.exists()
    target.write_text(SCRATCH_FAMILY)
    code = f"ROOT = {str(src)!r}\n" + textwrap.dedent(CHILD)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("loaded")


def _family(name, classes):
    llama = FAMILIES["llama"]
    return Family(
        name=name,
        classes=classes,
        to_config=llama.to_config,
        hf_fields=llama.hf_fields,
        layer_prefix=llama.layer_prefix,
        layer_rules=llama.layer_rules,
        global_rules=llama.global_rules,
    )


def test_a_class_already_taken_is_refused_by_name():
    before = dict(FAMILIES)
    with pytest.raises(
        ConfigError,
        match=r"'llama2'.*\['LlamaForCausalLM'\].*registered family 'llama'",
    ):
        register_family(_family("llama2", ("MyLlama", "LlamaForCausalLM")))
    with pytest.raises(ConfigError, match=r"\['BertModel'\].*family 'bert'"):
        register_family(_family("my_bert", ("BertModel",)))
    assert FAMILIES == before


def test_registering_under_the_same_name_replaces():
    old = FAMILIES["llama"]
    try:
        new = register_family(_family("llama", ("LlamaForCausalLM",)))
        assert FAMILIES["llama"] is new
    finally:
        register_family(old)
    assert FAMILIES["llama"] is old


def test_a_family_states_one_layout():
    """Either every rule at once (`rules=`) or per layer (`layer_prefix`
    with `{i}`, `layer_rules`, `global_rules`), never both or neither."""
    llama = FAMILIES["llama"]
    base = dict(name="x", classes=("X",), to_config=llama.to_config,
                hf_fields=llama.hf_fields)  # fmt: skip
    with pytest.raises(ConfigError, match=r"Family 'x': give either rules="):
        Family(**base)
    with pytest.raises(ConfigError, match=r"Family 'x': give either rules="):
        Family(**base, rules=lambda cfg, cls: [], layer_prefix="m.{i}.",
               layer_rules=llama.layer_rules,
               global_rules=llama.global_rules)  # fmt: skip
    with pytest.raises(ConfigError, match=r"layer_prefix='model.layers.'"):
        Family(**base, layer_prefix="model.layers.", layer_rules=llama.layer_rules,
               global_rules=llama.global_rules)  # fmt: skip


def test_one_registry_holds_decoders_and_encoders():
    """Every module of the folder registered its families, in one dict:
    the ten decoders (the per-layer layout) and the encoders."""
    from blocklab.interop import families

    assert sorted(families.__all__) == sorted(MODULES)
    module_of = {f.name: f.to_config.__module__.rsplit(".", 1)[-1] for f in
                 FAMILIES.values()}  # fmt: skip
    assert set(module_of.values()) == set(MODULES)
    assert set(decoder_families()) == {
        "gemma2", "gemma3", "gpt2", "llama", "mistral", "mixtral", "olmo2",
        "phi3", "qwen2", "qwen3",
    }  # fmt: skip
    for name in ("bert", "modernbert", "vit", "t5", "umt5", "mt5", "whisper"):
        assert name in FAMILIES and not FAMILIES[name].layered
    classes = [c for f in FAMILIES.values() for c in f.classes]
    assert len(classes) == len(set(classes))


@pytest.mark.parametrize("module", MODULES)
def test_the_old_module_paths_are_gone(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"blocklab.interop.{module}")
    importlib.import_module(f"blocklab.interop.families.{module}")


def test_the_second_conversion_module_is_gone():
    """The encoders' own machinery (`hf_encoder`: its family type, rule type,
    registry, loader and saver) is folded into the one path."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("blocklab.interop.hf_encoder")
    import blocklab.interop as interop

    for name in ("HFFamily", "EncoderFamily", "EncRule", "ENCODER_FAMILIES"):
        assert not hasattr(interop, name), name


@pytest.mark.parametrize(
    "rule, ours, theirs",
    [
        (Rule("t", ("a",), "lead", lead=2), [np.arange(6.0).reshape(2, 3)],
         np.arange(6.0).reshape(1, 1, 2, 3)),
        (Rule("t", ("a", "b"), "cat"), [np.ones((1, 2)), np.zeros((2, 2))],
         np.array([[1.0, 1], [0, 0], [0, 0]])),
        (Rule("t", ("a",), "T"), [np.arange(6.0).reshape(2, 3)],
         np.arange(6.0).reshape(2, 3).T),
    ],
)  # fmt: skip
def test_one_rule_type_for_every_layout(rule, ours, theirs):
    """The layouts the encoders used (`lead`: ViT's leading axes of one;
    `cat`: ModernBERT's fused `Wqkv`) are kinds of the one `Rule`: each way
    against the hand-built array, and the shape without data."""
    np.testing.assert_array_equal(rule.to_hf(ours), theirs)
    if rule.kind != "cat":  # equal parts only: split the equal-part case below
        for a, b in zip(rule.from_hf(theirs), ours, strict=True):
            np.testing.assert_array_equal(a, b)
    assert rule.hf_shape([a.shape for a in ours]) == theirs.shape


def test_cat_rule_splits_equal_parts():
    rule = Rule("t", ("a", "b"), "cat")
    a, b = rule.from_hf(np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(a, [[0.0, 1], [2, 3]])
    np.testing.assert_array_equal(b, [[4.0, 5], [6, 7]])
    assert json.dumps(rule.hf_shape([(2, 2), (2, 2)])) == "[4, 2]"
