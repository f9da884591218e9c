"""lm-eval: `--model blocklab` (`blocklab.text.lm_eval`) against the harness.

The reference is the harness's own Hugging Face backend (`--model hf`,
`HFLM`, torch and `transformers`) on the same checkpoint folder, built here
(nothing downloads): a tokenizer trained on the Time Machine text with
`tokenizers`, written by `transformers.LlamaTokenizer` (BOS added), and a
2-layer Llama with random weights written by `save_pretrained`. The task is
a YAML and a JSONL file in a temporary folder, read through
`TaskManager(include_path=...)`.

Both backends run with `max_length=24`, so that the long documents are
left-truncated, and the data has the cases the tokenization rules are about:
a context ending in a space (moved into the continuation), an empty context
(the prefix token), non-ASCII text, and a choice that is the model's greedy
continuation (so that `is_greedy` is true somewhere).

Skipped only when `lm-eval` is not installed (it is in the `dev` extra, so
CI runs it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from _procs import run  # noqa: E402

import blocklab as bl  # noqa: E402
from blocklab import ConfigError  # noqa: E402
from blocklab.text import lm_eval as bl_lm_eval  # noqa: E402

ML = 24  # max_length of both backends
BATCH = 3
#: Contexts whose greedy next token may be a choice (the first whose text
#: encodes back to that token after the context is).
GREEDY_CONTEXTS = ["The Time Traveller was", "It was", "the medical man"]
#: The choices follow the context as they are (`target_delimiter: ""`).
DOCS = [
    {"q": "The Time Traveller", "choices": [" explaining", " a man"], "label": 0},
    {
        "q": "Question: what is the fourth dimension? Answer: ",  # trailing space
        "choices": ["time", "space", " length"],
        "label": 0,
    },
    {"q": "", "choices": ["It was", "The", " café"], "label": 1},  # empty context
    {  # longer than max_length: left-truncated
        "q": " ".join(["the medical man said that"] * 8),
        "choices": [" nothing", " it is"],
        "label": 1,
    },
    {"q": "Über die Brücke", "choices": [" ging", "kam er"], "label": 0},
    {"q": "said the Psychologist.", "choices": ["\n\nThe", " Filby"], "label": 1},
]
ROLLING = [
    "The Time Traveller (for so it will be convenient to speak of him) was "
    "expounding a recondite matter to us. His grey eyes shone and twinkled.",
    "Über die Brücke, déjà vu 🙂",
    "time",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A Llama checkpoint folder: trained tokenizer, random weights."""
    import torch
    import transformers
    from hf_models import randomize
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from blocklab.data.datasets import corpus_path

    text = corpus_path().read_text(encoding="utf-8")[:20_000]
    corpus = [p for p in text.split("\n\n") if p.strip()]
    corpus += ["Le café est très bon. Über die Brücke ging er."] * 4
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) for m in model["merges"]]
    hf_tok = transformers.LlamaTokenizer(model["vocab"], merges, add_bos_token=True)
    path = tmp_path_factory.mktemp("lm_eval") / "llama"
    hf_tok.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = randomize(transformers.LlamaForCausalLM(cfg), seed=0, matrices=0.3)
    hf_model.save_pretrained(path)
    # a doc whose last choice is the model's greedy next token
    for context in GREEDY_CONTEXTS:
        ids = hf_tok(context).input_ids
        with torch.no_grad():
            token = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
        choice = hf_tok.decode([token])
        if hf_tok(context + choice).input_ids == [*ids, token]:
            break
    else:
        raise AssertionError("no greedy token of GREEDY_CONTEXTS round-trips")
    greedy = {"q": context, "choices": [" the", " and", choice], "label": 2}
    (path / "greedy_doc.json").write_text(json.dumps(greedy))
    return path


@pytest.fixture(scope="module")
def tasks(folder, tmp_path_factory) -> Path:
    """`tinymc`: multiple choice over DOCS (+ the greedy choice), local JSONL."""
    docs = [*DOCS, json.loads((folder / "greedy_doc.json").read_text())]
    tasks = tmp_path_factory.mktemp("tasks")
    data = tasks / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (tasks / "tinymc.yaml").write_text(
        "task: tinymc\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'target_delimiter: ""\n'
        "doc_to_target: label\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n",
        encoding="utf-8",
    )
    return tasks


@pytest.fixture(scope="module")
def task_manager(tasks):
    from lm_eval.tasks import TaskManager

    # only the task here: indexing the thousands of built-in ones takes seconds
    return TaskManager(include_path=str(tasks), include_defaults=False)


@pytest.fixture(scope="module")
def hf_lm(folder):
    """The reference: lm-eval's HFLM on the folder, float32 on the CPU."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=str(folder),
        device="cpu",
        dtype="float32",
        max_length=ML,
        batch_size=BATCH,
    )


@pytest.fixture(scope="module")
def ours(folder):
    return bl_lm_eval.BlocklabLM(
        pretrained=str(folder), max_length=ML, batch_size=BATCH
    )


def requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _evaluate(model, model_args, task_manager):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tinymc"],
        task_manager=task_manager,
        device="cpu",
        batch_size=BATCH,
        log_samples=True,
    )


def test_multiple_choice_equals_the_hf_backend(folder, task_manager):
    """Per request: the log-likelihood (to float32 rounding) and is_greedy;
    per task: the accuracy. Both through `simple_evaluate` by model name."""
    bl_lm_eval.register()
    want = _evaluate(
        "hf", f"pretrained={folder},dtype=float32,max_length={ML}", task_manager
    )
    got = _evaluate("blocklab", f"pretrained={folder},max_length={ML}", task_manager)
    ws, gs = want["samples"]["tinymc"], got["samples"]["tinymc"]
    assert [s["arguments"] for s in gs] == [s["arguments"] for s in ws]
    w = [r for s in ws for (r,) in s["resps"]]
    g = [r for s in gs for (r,) in s["resps"]]
    np.testing.assert_allclose(
        [x[0] for x in g], [x[0] for x in w], rtol=1e-5, atol=1e-5
    )
    assert [x[1] for x in g] == [x[1] for x in w]
    acc = got["results"]["tinymc"]["acc,none"]
    assert acc == want["results"]["tinymc"]["acc,none"]
    # the test's own premises: the cases are there
    args = [a for s in ws for a in s["arguments"]]
    assert any(x[1] for x in w), "no continuation is the greedy one"
    assert ("", "The") in [tuple(a) for a in args]
    tok = bl.load_tokenizer(folder)
    assert max(len(tok.encode(a[0] + a[1])) for a in args) > ML + 1


def test_loglikelihood_rolling_equals_the_hf_backend(hf_lm, ours):
    """Disjoint windows of max_length: the long text takes several."""
    reqs = requests("loglikelihood_rolling", [(t,) for t in ROLLING])
    got = ours.loglikelihood_rolling(reqs, disable_tqdm=True)
    want = hf_lm.loglikelihood_rolling(reqs, disable_tqdm=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(ours.tok_encode(ROLLING[0])) > 2 * ML  # several windows


def test_rolling_of_a_short_text_is_one_forward(ours, folder):
    """By hand: a text of fewer than max_length tokens scores each of its
    tokens after BOS and the ones before, in one forward pass."""
    model = bl.load_pretrained(folder)
    text = "The Time Traveller smiled."
    ids = ours.tok_encode(text)
    assert len(ids) < ML
    inp = np.asarray([ours.prefix_token_id, *ids[:-1]], np.int32)
    z = np.asarray(model(inp), np.float64)
    top = z.max(-1, keepdims=True)
    logp = z - top - np.log(np.exp(z - top).sum(-1, keepdims=True))
    want = logp[np.arange(len(ids)), ids].sum()
    (got,) = ours.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_generate_until_equals_the_hf_backend(hf_lm, ours):
    """Greedy text, cut at the `until` strings, for contexts short and longer
    than the room max_length leaves (left-truncated)."""
    prompts = [
        "The Time Traveller was",
        "Über die",
        " ".join(["the medical man said"] * 6),
    ]
    free = {"until": [], "max_gen_toks": 8, "do_sample": False}
    raw = ours.generate_until(
        requests("generate_until", [(p, free) for p in prompts]), disable_tqdm=True
    )
    # a stop string inside the first text: it must cut there
    stop = raw[0][3:6]
    assert stop and raw[0].index(stop) == 3
    kwargs = [
        {"until": [stop], "max_gen_toks": 8, "do_sample": False},
        {"until": ["\n\n"], "max_gen_toks": 8, "temperature": 0.0},
        {"until": "zzz", "max_new_tokens": 8},  # an alias of max_gen_toks
    ]
    reqs = requests("generate_until", list(zip(prompts, kwargs, strict=True)))
    got = ours.generate_until(reqs, disable_tqdm=True)
    assert got == hf_lm.generate_until(reqs, disable_tqdm=True)
    assert got[0] == raw[0][:3]
    assert got[1:] == raw[1:]
    assert len(ours.tok_encode(prompts[2])) > ML - 8  # truncated


def test_tok_encode_is_hflm_s(hf_lm, ours, folder):
    """tok_encode: BOS added, or not where the text starts with it, or not
    at all with add_bos_token=False (as HFLM's argument)."""
    from lm_eval.models.huggingface import HFLM

    texts = ["The café", "<s>The café", " leading", "ends with a space "]
    for text in texts:
        assert ours.tok_encode(text) == hf_lm.tok_encode(text)
        for add in (True, False):
            assert ours.tok_encode(text, add) == hf_lm.tok_encode(text, add)
    hf_off = HFLM(
        pretrained=str(folder), device="cpu", dtype="float32", add_bos_token=False
    )
    off = bl_lm_eval.BlocklabLM(pretrained=str(folder), add_bos_token=False)
    for text in texts:
        assert off.tok_encode(text) == hf_off.tok_encode(text)
    assert off.tok_encode("The")[:1] != [off.tokenizer.bos_id]


def test_an_empty_context_is_the_prefix_token(folder):
    """prefix_token_id: what an empty context and a rolling text start from
    (EOS here instead of BOS), as HFLM's argument of that name."""
    from lm_eval.models.huggingface import HFLM

    eos = bl.load_tokenizer(folder).eos_id
    kw = dict(pretrained=str(folder), max_length=ML, prefix_token_id=eos)
    hf = HFLM(device="cpu", dtype="float32", batch_size=BATCH, **kw)
    mine = bl_lm_eval.BlocklabLM(batch_size=BATCH, **kw)
    assert mine.prefix_token_id == eos
    reqs = requests("loglikelihood", [("", "The Time"), ("", "</s> time")])
    got = mine.loglikelihood(reqs, disable_tqdm=True)
    want = hf.loglikelihood(reqs, disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
    reqs = requests("loglikelihood_rolling", [("The Time Traveller",)])
    np.testing.assert_allclose(
        mine.loglikelihood_rolling(reqs, disable_tqdm=True),
        hf.loglikelihood_rolling(reqs, disable_tqdm=True),
        rtol=1e-5,
    )


def test_dtype_converts_the_parameters(folder):
    import jax.numpy as jnp

    half = bl_lm_eval.BlocklabLM(pretrained=str(folder), dtype="bfloat16")
    assert half.model.token_emb.weight.dtype == jnp.bfloat16
    stored = bl_lm_eval.BlocklabLM(pretrained=str(folder), dtype="auto")
    assert stored.model.token_emb.weight.dtype == jnp.float32


def test_a_model_in_memory_scores_as_its_folder(ours, folder):
    model = bl.load_pretrained(folder)
    mem = bl_lm_eval.BlocklabLM(
        pretrained=model, tokenizer=folder, max_length=ML, batch_size=BATCH
    )
    reqs = requests("loglikelihood", [("Über die", " Brücke"), ("", " time")])
    assert mem.loglikelihood(reqs, disable_tqdm=True) == ours.loglikelihood(
        reqs, disable_tqdm=True
    )


def test_the_device_is_jax_s(folder):
    """`device="cpu"` places the model there; a platform JAX lacks (the
    command line's default "cuda:0" on a CPU machine) is JAX's default
    device; an index past the devices is refused."""
    import jax

    cpu = bl_lm_eval.BlocklabLM(pretrained=str(folder), device="cpu")
    assert cpu.model.token_emb.weight.devices() == {jax.devices("cpu")[0]}
    n = len(jax.devices("cpu"))
    with pytest.raises(ConfigError, match=f"JAX has {n} cpu device"):
        bl_lm_eval.BlocklabLM(pretrained=str(folder), device=f"cpu:{n}")
    if jax.default_backend() == "cpu":
        gpu = bl_lm_eval.BlocklabLM(pretrained=str(folder), device="cuda:0")
        assert gpu.model.token_emb.weight.devices() == {jax.devices()[0]}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"parallelize": True}, "unknown model argument"),
        ({"batch_size": "auto"}, "batch_size='auto' is not supported"),
        ({"batch_size": 0}, "batch_size must lie in"),
        ({"device": "mps"}, "device must be cpu, gpu"),
        ({"dtype": "int8"}, "dtype must be a floating dtype"),
        ({"max_length": 65}, "max_length must lie in"),
    ],
)
def test_bad_model_arguments_are_refused_by_name(folder, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        bl_lm_eval.BlocklabLM(pretrained=str(folder), **kwargs)


def test_a_model_and_tokenizer_that_do_not_fit_are_refused(folder, tmp_path):
    import jax

    model = bl.load_pretrained(folder)
    with pytest.raises(ConfigError, match="tokenizer is required"):
        bl_lm_eval.BlocklabLM(pretrained=model)
    with pytest.raises(ConfigError, match="dtype='bfloat16' is for a checkpoint"):
        bl_lm_eval.BlocklabLM(pretrained=model, tokenizer=folder, dtype="bfloat16")
    cfg = bl.DecoderConfig.llama(100, 16, 1, 1, num_kv_heads=1, max_len=32)
    small = bl.DecoderLM(cfg, key=jax.random.key(0))
    with pytest.raises(ConfigError, match="more than the model's vocab_size=100"):
        bl_lm_eval.BlocklabLM(pretrained=small, tokenizer=folder)
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_eos / name).write_bytes((folder / name).read_bytes())
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    (no_eos / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": None})
    )
    with pytest.raises(ConfigError, match="names no EOS token"):
        bl_lm_eval.BlocklabLM(pretrained=model, tokenizer=no_eos)


@pytest.mark.parametrize(
    "gen_kwargs, match",
    [
        ({"num_beams": 4}, r"gen_kwargs \['num_beams'\] are not supported"),
        ({"do_sample": True}, "needs temperature > 0"),
        ({"max_gen_toks": ML}, "leaves no room"),
        ({"until": [3]}, "until must be a string or a list of strings"),
    ],
)
def test_bad_gen_kwargs_are_refused_by_name(ours, gen_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ours.generate_until(requests("generate_until", [("The", gen_kwargs)]))


def test_chat_templates_are_refused_by_name(ours):
    with pytest.raises(ConfigError, match="--apply_chat_template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_sampling_is_deterministic_given_the_seed(folder):
    """do_sample=True draws; the same seed draws the same text."""
    kw = {"until": [], "max_gen_toks": 5, "do_sample": True, "temperature": 1.5}
    reqs = requests("generate_until", [("The Time", kw)] * 2)
    texts = [
        bl_lm_eval.BlocklabLM(
            pretrained=str(folder), seed=s, batch_size=2
        ).generate_until(reqs, disable_tqdm=True)
        for s in (1, 1, 2)
    ]
    assert texts[0] == texts[1] != texts[2]


def test_importing_blocklab_imports_no_harness_nor_torch():
    code = (
        "import sys, blocklab, blocklab.text.lm_eval as m\n"
        "heavy = ('lm_eval', 'torch', 'transformers')\n"
        "assert not [n for n in heavy if n in sys.modules], sys.modules.keys()\n"
        "m.register()\n"
        "assert 'lm_eval' in sys.modules and 'torch' not in sys.modules\n"
        "import lm_eval.api.registry as r\n"
        "assert r.get_model('blocklab') is m.BlocklabLM\n"
        "assert r.get_model('hf').__name__ == 'HFLM'  # lm-eval's own still there\n"
    )
    code_, out, err = run([sys.executable, "-c", code], timeout=300)
    assert code_ == 0, err[-3000:]


def _accuracy(output_path: Path) -> float:
    (result,) = output_path.rglob("results_*.json")
    return json.loads(result.read_text())["results"]["tinymc"]["acc,none"]


@pytest.mark.slow  # kept out of the default run for CI time
def test_main_is_the_harness_command_line(folder, tasks, task_manager, tmp_path):
    """`main(argv)`: lm-eval's command line with `--model blocklab` known; its
    accuracy is simple_evaluate's."""
    argv = [
        "--model", "blocklab",
        "--model_args", f"pretrained={folder},max_length={ML}",
        "--tasks", "tinymc", "--include_path", str(tasks),
        "--batch_size", str(BATCH), "--output_path", str(tmp_path),
    ]  # fmt: skip
    saved = list(sys.argv)
    bl_lm_eval.main(argv)
    assert sys.argv == saved
    want = _evaluate("blocklab", f"pretrained={folder},max_length={ML}", task_manager)
    assert _accuracy(tmp_path) == want["results"]["tinymc"]["acc,none"]


@pytest.mark.slow
def test_python_m_runs_the_command_line(folder, tasks, task_manager, tmp_path):
    """`python -m blocklab.text.lm_eval --model blocklab ...` in a fresh
    process gives simple_evaluate's accuracy."""
    code, out, err = run(
        [
            sys.executable, "-m", "blocklab.text.lm_eval",
            "--model", "blocklab",
            "--model_args", f"pretrained={folder},max_length={ML}",
            "--tasks", "tinymc", "--include_path", str(tasks),
            "--batch_size", str(BATCH), "--output_path", str(tmp_path),
        ],
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=600,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    bl_lm_eval.register()
    want = _evaluate("blocklab", f"pretrained={folder},max_length={ML}", task_manager)
    assert _accuracy(tmp_path) == want["results"]["tinymc"]["acc,none"]
