"""What a checkpoint folder needs besides its weights, and folders that lie.

- The token ids and the generation config survive `load_pretrained` ->
  `save_pretrained` (reference: `transformers`' own `generate` on the
  original folder and on ours); a model built from scratch says it has none.
- A tied head is stored once, as `transformers` stores it (reference: the
  tensor list of `transformers`' own `save_pretrained` of the same model).
- Overwriting through a symlink replaces the folder it points to; a folder
  that cannot be written is named, not the temporary folder.
- Folders that contradict themselves (an index beside a stray
  `model.safetensors`; a `model_type` of another family than the
  `architectures`) are refused, naming the conflict.
- A NaN or an infinity in a stored weight is refused by `load_pretrained` in
  the words of `load_state_dict`; so is an overflow under `dtype=`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from test_pretrained import hf_model, hf_save, leaves_equal

import blocklab
from blocklab._validate import ConfigError
from blocklab.interop.pretrained import load_pretrained, save_pretrained
from blocklab.models import DecoderConfig, DecoderLM
from blocklab.training.checkpoint import CheckpointError

V, T = 96, 16


def _llama(seed: int = 0, layers: int = 2) -> DecoderLM:
    return DecoderLM(
        DecoderConfig.llama(V, 32, 4, layers, max_len=T), key=jax.random.key(seed)
    )


def _json(file: Path):
    return json.loads(file.read_text())


def _tensor_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            keys.extend(f.keys())
    return sorted(keys)


def _from_pretrained(folder: Path):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager"
        ).eval()


# Section 2: token ids and generation config ------------------------------------


def _greedy(hf, prompt: np.ndarray, n: int) -> list[int]:
    """`n` greedy tokens after `prompt`, by hand (argmax of the full forward)."""
    import torch

    ids = torch.as_tensor(prompt[None])
    with torch.no_grad():
        for _ in range(n):
            nxt = hf(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _generate(hf, prompt: np.ndarray, n: int) -> list[int]:
    import torch

    ids = torch.as_tensor(prompt[None])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=n,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_round_trip_keeps_token_ids_and_generate_stops_at_eos(tmp_path):
    """A transformers folder whose EOS greedy decoding emits at step >= 2:
    transformers stops there on the original, on load_pretrained ->
    save_pretrained(source=) of it, and not on a save that has no ids."""
    hf = hf_model("llama")
    prompt = np.array([5, 17, 33, 2, 60])
    free = _greedy(hf, prompt, 10)
    step = next(i for i in range(2, 10) if free[i] not in free[:i])
    eos = free[step]
    never = next(t for t in range(V) if t not in free)
    hf.config.update(dict(bos_token_id=1, eos_token_id=eos, pad_token_id=never))
    hf.generation_config.bos_token_id = 1
    hf.generation_config.eos_token_id = [eos, never]  # config.json: just `eos`
    hf.generation_config.pad_token_id = never
    original = hf_save(hf, tmp_path / "original")
    want = _generate(_from_pretrained(original), prompt, 10)
    assert want == free[: step + 1]  # the original stops at its EOS

    model = load_pretrained(original)
    ours = save_pretrained(model, tmp_path / "ours", source=original)
    config, gen = _json(ours / "config.json"), _json(ours / "generation_config.json")
    orig_gen = _json(original / "generation_config.json")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[k] == _json(original / "config.json")[k], k
    assert gen == orig_gen and gen["eos_token_id"] == [eos, never]
    assert _generate(_from_pretrained(ours), prompt, 10) == want

    # The plain round trip keeps them too: load_pretrained puts them in the
    # model's config, and a model changed (fine-tuned) keeps its config.
    assert model.cfg.eos_token_id == eos and model.cfg.bos_token_id == 1
    tuned = jax.tree_util.tree_map(
        lambda a: a * 1.0 if eqx.is_inexact_array(a) else a, model
    )
    plain = save_pretrained(tuned, tmp_path / "plain")
    assert _json(plain / "generation_config.json") == orig_gen
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert _json(plain / "config.json")[k] == _json(original / "config.json")[k]
    assert _generate(_from_pretrained(plain), prompt, 10) == want
    assert load_pretrained(plain).cfg == model.cfg

    # A model whose config has none says so: generate runs to its limit.
    bare = save_pretrained(_without_usage(model), tmp_path / "bare")
    assert _generate(_from_pretrained(bare), prompt, 10) == free


def _without_usage(model):
    """`model` with the token ids and generation config cleared from its config."""
    cfg = dataclasses.replace(
        model.cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        generation_config=None,
    )  # fmt: skip
    out = copy.copy(model)
    object.__setattr__(out, "cfg", cfg)
    return out


def test_a_model_from_scratch_says_it_has_no_ids(tmp_path):
    """Null ids in config.json (not the class defaults transformers fills
    in, e.g. GPT-2's 50256, outside a 96-token vocabulary) and a generation
    config derived from them, as transformers derives it."""
    gpt2 = DecoderLM(DecoderConfig.gpt2(V, 32, 4, 1, max_len=T), key=jax.random.key(0))
    out = save_pretrained(gpt2, tmp_path / "g")
    config = _json(out / "config.json")
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [
        None,
        None,
        None,
    ]
    assert _json(out / "generation_config.json") == {"_from_model_config": True}
    back = _from_pretrained(out)
    assert back.config.bos_token_id is None and back.config.eos_token_id is None
    assert back.generation_config.eos_token_id is None


def test_token_ids_and_generation_config_replace_those_of_source(tmp_path):
    model = _llama(layers=1)
    src = save_pretrained(
        model, tmp_path / "src", token_ids={"bos_token_id": 1, "eos_token_id": 2}
    )
    assert _json(src / "generation_config.json") == {
        "_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    # a source's generation config is kept whole; a given id replaces its own
    (src / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "max_new_tokens": 7, "temperature": 0.5})
    )
    out = save_pretrained(
        model,
        tmp_path / "a",
        source=src,
        token_ids={"eos_token_id": np.array([3, 4])[:1].tolist() + [np.int64(4)]},
    )
    config = _json(out / "config.json")
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [3, 4])
    assert config["pad_token_id"] is None
    assert _json(out / "generation_config.json") == {
        "eos_token_id": [3, 4], "max_new_tokens": 7, "temperature": 0.5,
    }  # fmt: skip
    # generation_config= replaces the source's; an id the source's config.json
    # leaves out stays out (transformers' class default, as for the source)
    raw = _json(src / "config.json")
    del raw["pad_token_id"]
    (src / "config.json").write_text(json.dumps(raw))
    out = save_pretrained(
        model, tmp_path / "b", source=src, generation_config={"top_k": 5}
    )
    assert "pad_token_id" not in _json(out / "config.json")
    assert _json(out / "generation_config.json") == {"top_k": 5}


BAD_USAGE = [
    (dict(token_ids={"eos": 1}), r"token_ids has the keys \['eos'\]; the valid keys"),
    (dict(token_ids={"eos_token_id": V}), r"\['eos_token_id'\]=96 .*\[0, 96\)"),
    (dict(token_ids={"bos_token_id": True}), r"token_ids\['bos_token_id'\]=True"),
    (dict(token_ids={"bos_token_id": [1, 2]}), r"bos_token_id'\]=\[1, 2\]"),
    (dict(token_ids={"eos_token_id": []}), r"eos_token_id'\]=\[\] .*list of such ints"),
    (dict(token_ids=[("eos_token_id", 1)]), r"token_ids must be a dict"),
    (dict(generation_config=3), r"generation_config must be a dict .*to_dict"),
    (dict(generation_config={"eos_token_id": -1}), r"config eos_token_id=-1 is"),
    (dict(generation_config={"x": float("nan")}), r"config cannot be .*JSON"),
    (dict(source=3), r"source must be a folder name"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs,match", BAD_USAGE)
def test_bad_ids_and_generation_configs_are_refused_by_name(
    kwargs, match, tmp_path, plain_python
):
    with pytest.raises(ConfigError, match=match):
        save_pretrained(_llama(layers=1), tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_source_that_is_not_a_checkpoint_or_does_not_fit_is_refused(tmp_path):
    model = _llama(layers=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"source='.*empty' is not a checkpoint"):
        save_pretrained(model, tmp_path / "out", source=tmp_path / "empty")
    src = save_pretrained(model, tmp_path / "src")
    raw = _json(src / "config.json")
    (src / "config.json").write_text(json.dumps({**raw, "eos_token_id": 500}))
    with pytest.raises(
        ConfigError, match=r"source .*config.json: eos_token_id=500 is not a token id"
    ):
        save_pretrained(model, tmp_path / "out", source=src)
    (src / "config.json").write_text(json.dumps(raw))
    (src / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"generation_config.json is not a JSON obj"):
        save_pretrained(model, tmp_path / "out", source=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "src"]


# Section 2: a tied head is stored once -------------------------------------------


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "llama"])
def test_tensor_list_is_that_of_transformers(family, tmp_path):
    """Our file's tensors are exactly those transformers' save_pretrained
    writes for the same model: no lm_head.weight for a tied head (Gemma 3,
    GPT-2), one for an untied one (Llama)."""
    hf = hf_model(family)
    theirs = _tensor_keys(hf_save(hf, tmp_path / "theirs"))
    ours = _tensor_keys(save_pretrained(blocklab.from_huggingface(hf), tmp_path / "o"))
    assert ours == theirs
    tied = family != "llama"
    assert hf.config.tie_word_embeddings == tied
    assert ("lm_head.weight" in ours) == (not tied)


# Section 6: symlinks and folders that cannot be written ---------------------------


def test_overwrite_through_a_symlink_replaces_the_target(tmp_path):
    old, new = _llama(0, 1), _llama(1, 1)
    real, link = tmp_path / "real", tmp_path / "link"
    save_pretrained(old, real)
    real.chmod(0o750)
    link.symlink_to(real, target_is_directory=True)
    assert save_pretrained(new, link, overwrite=True) == link
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert leaves_equal(load_pretrained(real), new)
    assert oct(real.stat().st_mode & 0o777) == oct(0o750)  # the folder's mode kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_a_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    model = _llama(layers=1)
    target = save_pretrained(model, tmp_path / "t")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", f"{dir}/.m.abc.tmp")

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", refuse)
        with pytest.raises(
            PermissionError,
            match=rf"save_pretrained: cannot write 'new' into the folder "
            rf"'{tmp_path}' \(Permission denied\)",
        ) as err:
            save_pretrained(model, tmp_path / "new")
    assert ".tmp" not in str(err.value)
    real_replace = os.replace

    def failing_replace(src, dst):  # the rename of the new folder fails
        if Path(dst) == target and str(src).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", failing_replace)
        with pytest.raises(OSError, match=r"cannot write 't' into the folder") as err:
            save_pretrained(_llama(1, 1), target, overwrite=True)
    assert ".tmp" not in str(err.value) and ".old" not in str(err.value)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self").exists(),
    reason="needs Linux's /proc",
)
def test_save_into_proc_names_the_users_path():
    with pytest.raises(OSError) as err:
        save_pretrained(_llama(layers=1), "/proc/m")
    assert "'m' into the folder '/proc'" in str(err.value)
    assert ".tmp" not in str(err.value)


# Section 6: folders that contradict themselves ----------------------------------


def test_an_index_beside_a_stray_weights_file_is_refused(tmp_path):
    model = _llama()
    sharded = save_pretrained(model, tmp_path / "s", max_shard_size="30KB")
    assert load_pretrained(sharded) is not None
    other = save_pretrained(_llama(1), tmp_path / "one")
    shutil.copy(other / "model.safetensors", sharded / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"holds both model.safetensors.index.json \(listing \d+ shard\(s\)\) "
        r"and a model.safetensors it does not list",
    ):
        load_pretrained(sharded)
    # transformers indeed reads the stray file: another model
    got = blocklab.from_huggingface(_from_pretrained(sharded))
    assert leaves_equal(got, load_pretrained(other))


def test_a_model_type_of_another_family_is_refused(tmp_path):
    folder = save_pretrained(_llama(), tmp_path / "m")
    raw = _json(folder / "config.json")

    def write(**fields):
        (folder / "config.json").write_text(json.dumps({**raw, **fields}))

    write(model_type="gpt2")
    with pytest.raises(
        CheckpointError,
        match=r"architectures=\['LlamaForCausalLM'\] and model_type='gpt2' name "
        r"different model families \(gpt2, llama\)",
    ):
        load_pretrained(folder)
    with pytest.raises(CheckpointError, match="model_type='gpt2'"):
        blocklab.interop.pretrained_config(folder)
    write(architectures=["LlamaForCausalLM", "GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"different model families"):
        load_pretrained(folder)
    # agreeing, absent or unregistered model types read as the architecture says
    for fields in ({}, {"model_type": None}, {"model_type": "my_llama"}):
        write(**fields)
        assert blocklab.interop.pretrained_config(folder).num_blks == 2


# Section 6: non-finite weights -------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_non_finite_weights_are_refused_as_load_state_dict_does(bad, tmp_path):
    from safetensors.numpy import load_file, save_file

    model = _llama()
    folder = save_pretrained(model, tmp_path / "m")
    file = folder / "model.safetensors"
    sd = load_file(file)
    key = "model.layers.1.self_attn.q_proj.weight"  # stored as ours: (out, in)
    sd[key][2, 5] = bad
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as got:
        load_pretrained(folder)
    ours = blocklab.state_dict(model)
    ours["stack.blocks.1.attention.W_q.weight"] = sd[key]
    with pytest.raises(ConfigError) as ref:
        blocklab.load_state_dict(model, ours)
    rule = str(ref.value).split("'stack.blocks.1.attention.W_q.weight' ", 1)[1]
    assert rule.startswith("holds 1 non-finite value(s) (first: ")
    assert f"(first: {bad} at index [2, 5]); refusing to load NaN or infinite" in rule
    assert str(got.value) == f"load_pretrained: {file}: tensor {key!r} {rule}"


def test_an_overflow_under_dtype_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = save_pretrained(_llama(), tmp_path / "m")
    file = folder / "model.safetensors"
    sd = load_file(file)
    key = "model.layers.0.mlp.up_proj.weight"
    sd[key][0, 0] = 1e6  # finite in float32, inf in float16
    save_file(sd, file, metadata={"format": "pt"})
    assert load_pretrained(folder) is not None
    with pytest.raises(
        ConfigError,
        match=rf"'{key}' overflows dtype=float16 \(its largest magnitude is "
        r"1000000.0\); pass a wider dtype=",
    ):
        load_pretrained(folder, dtype="float16")


def test_an_integer_weight_is_refused_and_a_bf16_one_loads(tmp_path):
    """`TensorInfo.check_float`: a weight stored as I32 cannot become a
    parameter (refused, naming the key and the stored type); BF16 can."""
    from safetensors.numpy import load_file, save_file

    cfg = DecoderConfig.llama(vocab_size=32, num_hiddens=16, num_heads=2, num_blks=1)
    save_pretrained(DecoderLM(cfg, key=jax.random.key(0)), tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    name = "model.norm.weight"
    import ml_dtypes

    save_file({**tensors, name: tensors[name].astype(ml_dtypes.bfloat16)}, path)
    load_pretrained(tmp_path / "m")  # BF16 is floating point
    save_file({**tensors, name: tensors[name].astype(np.int32)}, path)
    refusal = rf"'{name}' is stored as I32, which cannot be converted"
    with pytest.raises(CheckpointError, match=refusal):
        load_pretrained(tmp_path / "m")
