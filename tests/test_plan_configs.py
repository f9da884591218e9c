"""`blocklab plan` on the configs users have, on meshes and batches as training
takes them.

References: `transformers` models built from tiny configs (nothing downloads)
and their own `num_parameters()`, for every family `load_pretrained` reads;
`train_model` itself on simulated devices (which batches it refuses); hand
counts of which mesh axes a preset splits over.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import warnings

import jax
import pytest
from _procs import script_json
from strict_json import strict_object
from test_pretrained import HF_CASES, SMALL, V

from blocklab import ConfigError, DecoderConfig, DecoderLM
from blocklab.interop import config_of
from blocklab.interop.hf_common import decoder_families
from blocklab.models.moe_decoder import MoEDecoderConfig
from blocklab.training.plan import check_global_batch, plan

#: The registered decoder families (the encoders: test_hf_encoders).
FAMILIES = decoder_families()


def _hf_config_and_model(family):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    config_cls, model_cls, fields = HF_CASES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(vocab_size=V, **SMALL, **fields)
        return config, getattr(transformers, model_cls)(config)


def _save(obj, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj.save_pretrained(folder)
    return folder


# ----------------------------------------------------------- configs users have


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_transformers_config_and_a_checkpoint_folder_plan_that_model(
    family, tmp_path
):
    """config.json (under any name) and the checkpoint folder both plan the
    transformers model: its parameter count, and the same bytes."""
    config, model = _hf_config_and_model(family)
    file = tmp_path / f"{family}-config.json"
    shutil.copy(_save(config, tmp_path / "config") / "config.json", file)
    folder = _save(model, tmp_path / "checkpoint")
    from_file = plan(config_of(str(file)), "data=2", batch=2)
    from_folder = plan(config_of(folder), "data=2", batch=2)
    assert from_file.num_params == model.num_parameters() > 0
    assert from_folder.num_params == model.num_parameters()
    assert from_file.params_bytes == from_folder.params_bytes > 0
    assert from_file.opt_bytes == from_folder.opt_bytes
    # a config.json inside its folder, named as such, reads the same
    assert config_of(str(folder / "config.json")) == config_of(folder)


def test_a_transformers_config_is_refused_as_load_pretrained_refuses_it(tmp_path):
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match=r"config=.*bert\.json.*BertForMaskedLM.*"
                       r"supported.*LlamaForCausalLM"):  # fmt: skip
        config_of(str(bert))
    llama = dict(architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=32,
                 num_attention_heads=4, num_hidden_layers=2,
                 max_position_embeddings=32, rms_norm_eps=1e-5,
                 intermediate_size=48, hidden_act="silu")  # fmt: skip
    bad = tmp_path / "llama.json"
    bad.write_text(json.dumps({**llama, "frobnicate": 1}))
    with pytest.raises(ConfigError, match=r"llama\.json.*frobnicate=1.*not supported"):
        config_of(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"config=.*empty.*no config\.json"):
        config_of(empty)
    kinds = r"config must be a preset \[.*llama3-8b.*checkpoint folder.*config\.json"
    with pytest.raises(ConfigError, match=kinds + r".*got 'llama-9000'"):
        config_of("llama-9000")


@pytest.mark.slow  # kept out of the default run for CI time
def test_a_mixture_of_experts_saved_by_init_args_plans_and_compiles(tmp_path):
    """`DecoderLM.init_args()` of a MoE model names its class; the plan
    builds that class, also in the compiled step."""
    cfg = MoEDecoderConfig.mixtral(32, 16, 2, 1, num_experts=4, max_len=8)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(DecoderLM(cfg, key=jax.random.key(0)).init_args()))
    assert config_of(str(path)) == cfg
    r = plan(config_of(str(path)), "data=1", batch=1, seq_len=8, compile=True)
    assert r.num_params == plan(cfg, "data=1").num_params and r.temp_bytes > 0


# ----------------------------------------------------------------- mesh axes


@pytest.mark.parametrize(
    "mesh, rules, unused",
    [
        ("data=8,model=4", "fsdp", {"model": 4}),  # the README's example
        ("data=8,model=4", "fsdp+tp", {}),
        ("data=4", "dp", {}),  # dp splits the batch over data
        ("data=1,model=8", "tp", {}),  # an axis of size 1 holds one copy anyway
        ("data=2,expert=2,model=2", "fsdp+ep", {"model": 2}),
        ("data=2,pipe=3", {"embed": "data"}, {"pipe": 3}),  # a mapping, no batch
    ],
)
def test_an_axis_the_rules_do_not_use_is_shown(mesh, rules, unused):
    r = plan("llama3-8b", mesh, rules=rules, batch=24)
    assert r.unused_axes == unused
    assert r.to_json()["unused_axes"] == unused
    table = r.table()
    for axis, size in unused.items():
        # its own column, and a note naming what would use it
        assert f"{axis}={size}" in table.splitlines()[2]
        assert f"nothing is split over {axis!r}" in table
    if unused:
        # the figures are those of the mesh without the unused axes
        rest = {a: n for a, n in r.mesh.items() if a not in unused}
        without = plan("llama3-8b", rest, rules=rules, batch=24)
        assert (r.params_bytes, r.opt_bytes) == (without.params_bytes,
                                                 without.opt_bytes)  # fmt: skip
    else:
        assert "nothing is split" not in table


def test_the_note_names_the_preset_that_would_use_the_axis():
    table = plan("llama3-8b", "data=8,model=4").table()
    assert "rules fsdp+tp would split over 'model'" in table


# ------------------------------------------------------- batches training refuses

#: train_model on simulated devices: which (mesh, rules, batch) it refuses for
#: the batch. The source's ids are floats, which its loss check refuses after
#: the batch check: an accepted batch is told apart without compiling a step.
TRAIN = textwrap.dedent(
    """
    import json, sys
    import jax, optax
    from blocklab import ConfigError, DecoderConfig, DecoderLM
    from blocklab.training.placement import mesh_of
    from blocklab.training.run import train_model
    from blocklab import RunConfig

    cfg = DecoderConfig(**json.loads(sys.argv[1]))
    model = DecoderLM(cfg, key=jax.random.key(0))
    out = []
    for spec, rules, B in json.loads(sys.argv[2]):
        def source(key, B=B):
            X = jax.random.randint(key, (B, cfg.max_len + 1), 0, cfg.vocab_size)
            return X[:, :-1].astype(float), X[:, 1:].astype(float)
        try:
            train_model(model, source, optax.sgd(1e-2), 1, key=jax.random.key(1),
                        run=RunConfig(progress=False, mesh=mesh_of(spec),
                                      rules=rules))
            out.append("accepted")
        except ConfigError as err:
            out.append(str(err))
    print(json.dumps({"errors": out}))
    """
)
MESH_RULES = [
    ("data=4", "fsdp"), ("data=4", "dp"), ("data=2,model=2", "fsdp"),
    ("data=2,model=2", "fsdp+tp"), ("model=4", "tp"), ("data=2,expert=2", "ep"),
]  # fmt: skip


def test_plan_refuses_exactly_the_batches_train_model_refuses():
    cfg = DecoderConfig.llama(32, 16, 2, 1, max_len=8, ffn_width=16)
    cases = [(m, r, b) for m, r in MESH_RULES for b in (2, 3, 4)]
    errors = script_json(TRAIN, json.dumps(cfg.to_dict()), json.dumps(cases),
                         devices=4)["errors"]  # fmt: skip
    assert "accepted" not in errors  # every case reached the loss check
    trained = {c for c, e in zip(cases, errors, strict=True) if "divisible" in e}
    planned = set()
    for mesh, rules, batch in cases:
        try:
            plan(cfg, mesh, rules=rules, batch=batch, seq_len=8)
        except ConfigError as err:
            assert f"batch={batch} sequences do not split" in str(err)
            planned.add((mesh, rules, batch))
    assert ("data=2,model=2", "fsdp", 3) in trained  # the example
    assert ("model=4", "tp", 3) not in trained  # no axis carries the batch
    assert planned == trained


def test_a_refused_batch_and_length_name_the_fix_and_defaults_fit():
    with pytest.raises(ConfigError, match=r"batch=3 sequences.*\('data', 'expert'\)"
                       r".*4 devices.*multiple of 4 \(4\)"):  # fmt: skip
        check_global_batch(3, "data=2,expert=2", "ep")
    assert check_global_batch(3, "model=4", "tp") == 3
    with pytest.raises(ConfigError, match=r"seq_len=256.*max_len=128"):
        plan("llama", "data=2", batch=2, seq_len=256)
    # no batch given: the smallest multiple of the batch's devices >= 8
    assert plan("llama3-8b", "data=64").batch == 64
    assert plan("llama", "data=2,expert=3").batch == 12
    assert plan("llama3-8b", "model=4", rules="tp").batch == 8
    # no length given: the model's max_len (at most 2048)
    assert plan("llama", "data=2", batch=2).seq_len == 128
    assert plan("llama3-8b", "data=2", batch=2).seq_len == 2048


# ------------------------------------------------------------------- the CLI


def _cli(capsys, *argv):
    from blocklab.cli import app

    rc = app.main(["plan", *argv, "--json"])
    return rc, strict_object(capsys.readouterr().out)


def test_the_command_plans_a_checkpoint_folder(tmp_path, capsys):
    _, model = _hf_config_and_model("llama")
    folder = _save(model, tmp_path / "ckpt")
    rc, out = _cli(capsys, "--config", str(folder), "--mesh", "data=2",
                   "data=2,model=2", "--batch", "4")  # fmt: skip
    assert rc == 0, out
    first, second = out["plans"]
    assert first["num_params"] == model.num_parameters()
    assert (first["unused_axes"], second["unused_axes"]) == ({}, {"model": 2})


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--config", "llama", "--mesh", "data=2", "--batch", "3"],
         ["--batch=3", "multiple of 2 (2 or 4)"]),
        (["--config", "no-such", "--mesh", "data=2"],
         ["--config", "'no-such'", "llama3-8b", "checkpoint folder", "config.json"]),
        (["--config", "llama", "--mesh", "data=2", "--seq-len", "4096"],
         ["seq_len=4096", "max_len=128"]),
        (["--config", "llama", "--mesh", "data=2", "--rules", "tp"],
         ["'tp'", "'model'"]),
    ],
)  # fmt: skip
def test_the_command_refuses_by_name_in_json(argv, named, capsys):
    rc, out = _cli(capsys, *argv)
    assert rc == 2 and out["type"] == "ConfigError", out
    for text in named:
        assert text in out["error"], out
