"""PEFT LoRA folders both ways (issue 33, item 4): adapters written by
`peft` (random non-zero B) load with PEFT's logits, adapters written by
blocklab load in `peft` with blocklab's logits, and the refusals."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import LoRAConfig
from blocklab._validate import ConfigError
from blocklab.interop.huggingface import from_huggingface
from blocklab.interop.peft import load_adapter, save_adapter
from blocklab.interop.pretrained import save_pretrained
from blocklab.nn.lora import lora, lora_layers, merge_lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = np.arange(10) * 7 % 64


def _hf_llama(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)[None]).logits[0].numpy()


def _peft_folder(tmp_path, **kw):
    hf = _hf_llama()
    base = from_huggingface(hf)
    torch.manual_seed(1)
    config = peft.LoraConfig(init_lora_weights=False, **kw)
    pm = peft.get_peft_model(hf, config).eval()
    # init_lora_weights=False draws B at random too; make sure it is non-zero
    assert any(
        float(p.detach().abs().max()) > 0
        for n, p in pm.named_parameters()
        if "lora_B" in n
    )
    pm.save_pretrained(tmp_path)
    return base, _hf_logits(pm), tmp_path


@pytest.fixture(scope="module")
def qv_folder(tmp_path_factory):
    """A PEFT folder with q and v adapters on the 2-layer Llama (made once)."""
    return _peft_folder(
        tmp_path_factory.mktemp("qv"),
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
    )


def test_peft_qv_adapter_loads_with_equal_logits(qv_folder):
    base, want, folder = qv_folder
    model = load_adapter(base, folder)
    np.testing.assert_allclose(model(jnp.asarray(IDS)), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - _hf_logits(_hf_llama())).max() > 1e-3  # not a no-op


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"],
        ),
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "up_proj", "down_proj"],
            rank_pattern={"up_proj": 2},
            alpha_pattern={"down_proj": 3.0},
        ),
        pytest.param(
            dict(r=2, lora_alpha=4, target_modules=r".*\.(q|v)_proj"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["rslora", "patterns", "regex"],
)
def test_peft_adapter_loads_with_equal_logits(tmp_path, kw):
    base, want, folder = _peft_folder(tmp_path, **kw)
    model = load_adapter(base, folder)
    np.testing.assert_allclose(model(jnp.asarray(IDS)), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - _hf_logits(_hf_llama())).max() > 1e-3  # not a no-op
    if "rank_pattern" in kw:
        layers = lora_layers(model)
        assert layers["stack.blocks.ffn.W_1"].rank == 2
        assert layers["stack.blocks.ffn.W_2"].scale == 3.0 / 4


def _random_B(model, key):
    import equinox as eqx

    for k, (path, node) in zip(
        jax.random.split(key, 99), lora_layers(model).items(), strict=False
    ):

        def get(m, path=path):
            for name in path.split("."):
                m = getattr(m, name)
            return m.B

        model = eqx.tree_at(get, model, 0.3 * jax.random.normal(k, node.B.shape))
    return model


@pytest.mark.parametrize("use_rslora", [False, True])
def test_saved_adapter_loads_in_peft(tmp_path, use_rslora):
    hf = _hf_llama()
    adapted = _random_B(
        lora(
            from_huggingface(hf),
            LoRAConfig(
                rank=4,
                alpha=6.0,
                targets=["q", "k", "v", "o", "gate", "up", "down"],
                use_rslora=use_rslora,
            ),
            key=jax.random.key(3),
        ),  # fmt: skip
        jax.random.key(4),
    )
    save_adapter(adapted, tmp_path / "ad")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["use_rslora"] is use_rslora and config["r"] == 4
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    np.testing.assert_allclose(
        _hf_logits(pm), adapted(jnp.asarray(IDS)), rtol=1e-4, atol=1e-4
    )
    # and back: blocklab reads its own file
    again = load_adapter(from_huggingface(_hf_llama()), tmp_path / "ad")
    np.testing.assert_array_equal(again(jnp.asarray(IDS)), adapted(jnp.asarray(IDS)))


@pytest.mark.slow
def test_mixed_ranks_save_rank_pattern(tmp_path):
    hf = _hf_llama()
    base = from_huggingface(hf)
    model = lora(
        base, LoRAConfig(rank=4, alpha=8.0, targets=["q", "v"]), key=jax.random.key(1)
    )
    model = lora(
        model, LoRAConfig(rank=2, alpha=3.0, targets=["down"]), key=jax.random.key(2)
    )
    model = _random_B(model, jax.random.key(5))
    save_adapter(model, tmp_path / "ad")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"mlp.down_proj": 2}
    assert config["alpha_pattern"] == {"mlp.down_proj": 3.0}
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    np.testing.assert_allclose(
        _hf_logits(pm), model(jnp.asarray(IDS)), rtol=1e-4, atol=1e-4
    )


def test_merged_model_loads_in_transformers(tmp_path):
    adapted = _random_B(
        lora(
            from_huggingface(_hf_llama()),
            LoRAConfig(rank=4, alpha=8.0, targets=["q", "up"]),
            key=jax.random.key(3),
        ),  # fmt: skip
        jax.random.key(4),
    )
    save_pretrained(merge_lora(adapted), tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(
        _hf_logits(hf), adapted(jnp.asarray(IDS)), rtol=1e-4, atol=1e-4
    )


def _edit(folder, **fields):
    p = folder / "adapter_config.json"
    c = json.loads(p.read_text())
    c.update(fields)
    p.write_text(json.dumps(c))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(use_dora=True), "use_dora=True is not supported"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(layers_to_transform=[0]), "layers_to_transform"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out=True does not apply"),
        (dict(bias="all"), "bias='all'"),
        (dict(lora_alpha=float("nan")), "lora_alpha must be a finite"),
        (dict(target_modules=["q_proj", "v_proj", "nothing"]), "'nothing' names no"),
        (dict(target_modules=["v_proj"]), "does not name it"),
        (dict(rank_pattern={"q_proj": 2}), "another shape"),
        (dict(peft_type="IA3"), "peft_type must be 'LORA'"),
    ],
)
def test_refusals(qv_folder, tmp_path, fields, match):
    base, _, source = qv_folder
    folder = tmp_path / "ad"
    shutil.copytree(source, folder)
    _edit(folder, **fields)
    with pytest.raises(ConfigError, match=match):
        load_adapter(base, folder)


def test_refuses_other_architecture_and_twice(qv_folder, tmp_path):
    base, _, folder = qv_folder
    once = load_adapter(base, folder)
    with pytest.raises(ConfigError, match="adding adapters twice"):
        load_adapter(once, folder)
    # a one-layer Llama: layer 1's tensors name nothing there
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    small = from_huggingface(transformers.LlamaForCausalLM(cfg).eval())
    with pytest.raises(ConfigError, match="another architecture"):
        load_adapter(small, folder)
    # a wider Llama: the shapes do not fit
    cfg.hidden_size, cfg.num_hidden_layers = 48, 2
    wide = from_huggingface(transformers.LlamaForCausalLM(cfg).eval())
    with pytest.raises(ConfigError, match="another shape"):
        load_adapter(wide, folder)
    with pytest.raises(ConfigError, match="no adapters"):
        save_adapter(base, tmp_path / "x")


def _family_model(name):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "name, targets, peft_targets",
    [
        ("gpt2", ["o", "up", "down"], ["c_fc"]),  # Conv1D: fan_in_fan_out
        pytest.param(
            "qwen2",
            ["q", "k", "v", "o", "gate", "up", "down"],
            ["q_proj", "v_proj"],
            marks=pytest.mark.slow,
        ),  # biased q/k/v
    ],
)
def test_other_families_both_ways(tmp_path, name, targets, peft_targets):
    hf = _family_model(name)
    adapted = _random_B(
        lora(
            from_huggingface(hf),
            LoRAConfig(rank=4, alpha=8.0, targets=targets),
            key=jax.random.key(1),
        ),  # fmt: skip
        jax.random.key(4),
    )
    save_adapter(adapted, tmp_path / "mine")
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "mine").eval()
    np.testing.assert_allclose(
        _hf_logits(pm), adapted(jnp.asarray(IDS)), rtol=1e-4, atol=1e-4
    )
    hf = _family_model(name)
    base = from_huggingface(hf)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=peft_targets,
        init_lora_weights=False,
        fan_in_fan_out=name == "gpt2",
    )
    pm = peft.get_peft_model(hf, config).eval()
    pm.save_pretrained(tmp_path / "theirs")
    np.testing.assert_allclose(
        load_adapter(base, tmp_path / "theirs")(jnp.asarray(IDS)),
        _hf_logits(pm),
        rtol=1e-4,
        atol=1e-4,
    )
    if name == "gpt2":  # the fused c_attn has no per-projection adapter
        q = lora(
            base, LoRAConfig(rank=2, alpha=2.0, targets=["q"]), key=jax.random.key(0)
        )
        with pytest.raises(ConfigError, match="no PEFT module in the gpt2 family"):
            save_adapter(q, tmp_path / "q")
