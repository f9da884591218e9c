"""`load_tokenizer`: a checkpoint folder's tokenizer, read without transformers.

The reference is `transformers.AutoTokenizer.from_pretrained(folder)` (5.24)
on folders built here (nothing downloads): tokenizers trained on the Time
Machine text with `tokenizers`, wrapped in the `transformers` class of each
family and written with its `save_pretrained`, so each folder holds what
`transformers` writes:

- `gpt2`: byte-level BPE, `GPT2Tokenizer` (no BOS added);
- `llama`: byte-fallback BPE with a `Metaspace` pre-tokenizer,
  `LlamaTokenizer` (BOS added), a `[role]` chat template;
- `gemma`: byte-fallback BPE with spaces as `▁`, `GemmaTokenizer` (BOS added),
  Gemma's `<start_of_turn>` chat template;
- `chatml`: byte-level BPE with a `<|begin_of_text|>` post-processor,
  `TokenizersBackend` (Llama 3 / Qwen style), a ChatML template.

Then older folder formats (edited copies), and the refusals.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.data.datasets import corpus_path

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _procs import NO_TORCH_PRELUDE, run  # noqa: E402

#: Not in the training text: non-ASCII (some characters never seen, so byte
#: fallback), emoji (a skin tone, a ZWJ family, a flag), leading and trailing
#: spaces, tabs and newlines, and the special tokens of every family written
#: out (each is a special token in one folder and plain text in the others).
HELD_OUT = [
    "Quantum pancakes orbit Neptune at dawn.",
    " one leading space",
    "  two leading spaces, and two trailing  ",
    "tabs\tand\nnewlines\r\n  indented",
    "naïve café, déjà vu — “curly quotes” ½ € ñ",
    "Zürich, Größe, Straße",
    "日本語の文章です。東京",
    "Съешь же ещё этих мягких булок",
    "한국어 텍스트 ʬ ∑∫√",
    "emoji 🙂 🚀 👍🏽 👩‍👩‍👧 🇫🇷!",
    "",
    " ",
    "<|endoftext|>after, and end.<|endoftext|>",
    "<s> and </s> written out, a<s>b</s>c",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<eos>",
    "<|begin_of_text|><|im_start|>user\nhey 🙂<|im_end|>",
    "<unk> <pad> <mask>",
]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, 🙂 café?"},
    {"role": "assistant", "content": " Sure. "},
    {"role": "user", "content": "And 日本?"},
]

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
GEMMA_TEMPLATE = (  # Gemma's, with system turns folded into the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set loop_messages = "
    "messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages "
    "%}{% endif %}{% for message in loop_messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles "
    "must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "(message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set "
    "role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "(first if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}"
)
CHATML_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}
    {{- '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

FAMILIES = ("gpt2", "llama", "gemma", "chatml")
TEMPLATED = ("llama", "gemma", "chatml")


def _corpus() -> list[str]:
    text = corpus_path().read_text(encoding="utf-8")[:40_000]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    other = [  # a little non-ASCII, so that merges span multi-byte characters
        "Le café est très bon, déjà vu à Paris. Über die Brücke.",
        "Привет, как дела? Хорошо, спасибо.",
        "日本語を話します。今日はいい天気です。",
        "emoji 🙂🙂 🚀 ok",
    ]
    return paragraphs + other * 8


def _bpe(corpus, *, byte_level, specials, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # sentencepiece-like: pieces start with ▁, unknown characters as bytes
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        specials = [*specials, *(f"<0x{i:02X}>" for i in range(256))]
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _vocab_merges(tok):
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) for m in model["merges"]]


def _build(root: Path) -> dict[str, Path]:
    from tokenizers import processors

    corpus = _corpus()
    folders = {name: root / name for name in FAMILIES}

    tok = _bpe(corpus, byte_level=True, specials=["<|endoftext|>"], vocab_size=420)
    transformers.GPT2Tokenizer(*_vocab_merges(tok)).save_pretrained(folders["gpt2"])

    specials = ["<unk>", "<s>", "</s>"]
    tok = _bpe(corpus, byte_level=False, specials=specials, vocab_size=560)
    llama = transformers.LlamaTokenizer(*_vocab_merges(tok), add_bos_token=True)
    llama.chat_template = LLAMA_TEMPLATE
    llama.save_pretrained(folders["llama"])

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    turns = ["<start_of_turn>", "<end_of_turn>"]
    tok = _bpe(corpus, byte_level=False, specials=specials + turns, vocab_size=560)
    gemma = transformers.GemmaTokenizer(*_vocab_merges(tok), add_bos_token=True)
    gemma.add_special_tokens({"additional_special_tokens": turns})
    gemma.chat_template = GEMMA_TEMPLATE
    gemma.save_pretrained(folders["gemma"])

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok = _bpe(corpus, byte_level=True, specials=specials, vocab_size=440)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|end_of_text|>",
        chat_template=CHATML_TEMPLATE,
    ).save_pretrained(folders["chatml"])
    return folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return _build(tmp_path_factory.mktemp("tokenizers"))


_HF: dict[Path, object] = {}


def hf(folder: Path):
    """`AutoTokenizer.from_pretrained(folder)`, once per folder."""
    if folder not in _HF:
        _HF[folder] = transformers.AutoTokenizer.from_pretrained(folder)
    return _HF[folder]


def test_the_folders_are_what_transformers_writes(folders):
    """The fixtures are the formats under test (a check of the test itself)."""
    classes = {
        "gpt2": "GPT2Tokenizer",
        "llama": "LlamaTokenizer",
        "gemma": "GemmaTokenizer",
        "chatml": "TokenizersBackend",
    }
    for name, folder in folders.items():
        assert type(hf(folder)).__name__ == classes[name]
        assert (folder / "tokenizer.json").is_file()
        assert (folder / "chat_template.jinja").is_file() == (name in TEMPLATED)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_transformers(folders, family, add_special_tokens):
    tok, ref = bl.load_tokenizer(folders[family]), hf(folders[family])
    for text in HELD_OUT:
        want = ref.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == want, text
    if family in ("llama", "gemma"):  # an unseen character falls back to bytes
        raw = tokenizers.Tokenizer.from_file(str(folders[family] / "tokenizer.json"))
        want = [raw.token_to_id(f"<0x{b:02X}>") for b in "ʬ".encode()]
        assert tok.encode("ʬ", add_special_tokens=False)[-2:] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_decoded_text_equals_transformers(folders, family):
    tok, ref = bl.load_tokenizer(folders[family]), hf(folders[family])
    for text in HELD_OUT:
        ids = ref.encode(text)
        for skip in (False, True):
            want = ref.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special_tokens=skip) == want, (text, skip)
        assert tok.decode(np.asarray(ids, int)) == ref.decode(ids)  # arrays too
    # a token that is a fragment of a character (the first byte of an unseen
    # one) decodes alone to the replacement character
    piece = tok.encode("ʬ", add_special_tokens=False)[-2:-1]
    assert tok.decode(piece) == ref.decode(piece) == "\ufffd"


def test_byte_level_text_round_trips_exactly(folders):
    """Independent of transformers: byte-level BPE loses nothing."""
    tok = bl.load_tokenizer(folders["gpt2"])
    for text in HELD_OUT:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_and_the_bos_rule_as_transformers(folders, family):
    tok, ref = bl.load_tokenizer(folders[family]), hf(folders[family])
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert tok.vocab_size == len(ref)
    assert dict(tok.special_tokens) == ref.special_tokens_map
    assert tok.stop_ids == (ref.eos_token_id,)
    # by hand: Llama and Gemma folders add BOS, GPT-2 does not
    assert (
        tok.adds_bos
        == {"gpt2": False, "llama": True, "gemma": True, "chatml": True}[family]
    )
    assert tok.adds_bos == (ref.encode("x")[:1] == [ref.bos_token_id])
    first = tok.encode("Hello")[:1]
    assert (first == [tok.bos_id]) == tok.adds_bos
    assert tok.encode("Hello", add_special_tokens=False)[:1] != [tok.bos_id]


@pytest.mark.parametrize("tokenize", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("family", TEMPLATED)
def test_chat_template_renders_as_transformers(
    folders, family, add_generation_prompt, tokenize
):
    tok, ref = bl.load_tokenizer(folders[family]), hf(folders[family])
    got = tok.apply_chat_template(
        CHAT, add_generation_prompt=add_generation_prompt, tokenize=tokenize
    )
    want = ref.apply_chat_template(
        CHAT, add_generation_prompt=add_generation_prompt, tokenize=tokenize
    )
    assert got == (want["input_ids"] if tokenize else want)
    if not tokenize:
        tail = {"llama": "[assistant]", "gemma": "<start_of_turn>model\n"}.get(
            family, "<|im_start|>assistant\n"
        )
        assert got.endswith(tail) == add_generation_prompt


#: Everything `transformers` sets up for a template: namespace, loop controls,
#: `tojson` options, `dict`, `strftime_now`, the `generation` tag, tools, a key
#: missing from a message (lenient), `is defined`, `| default`, a reasoning
#: given as `thinking`, a key whose value is None (dropped), an extra variable,
#: and trim_blocks / lstrip_blocks on indented blocks.
RICH_TEMPLATE = """\
{%- set ns = namespace(count=0, system='none') -%}
{%- if messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] -%}
{%- endif -%}
{{ bos_token }}system={{ ns.system }}
{% if tools is not none %}
TOOLS {{ tools | tojson(indent=2, sort_keys=True) }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ message.role }} #{{ ns.count }}{{ ' name=' ~ message.name if message.name }}>
    {% if message.reasoning_content is defined %}
    [think]{{ message.reasoning_content }}|{{ message.thinking }}[/think]
    {% endif %}
    {% generation %}{{ message.content | trim }}{% endgeneration %}
    {% if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}
    {% if ns.count == 4 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b=[1, 'é']) | tojson(separators=(',', ':')) }} {{ dict.fromkeys('xy', 0) }}
year {{ strftime_now('%Y') }} {{ system_name | default('anon') }}
{% if style is defined %}style={{ style }}{% endif %}
{% if enable_thinking is defined and not enable_thinking %}no thinking{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

RICH_CHAT = [
    {"role": "system", "content": "Brief."},
    {"role": "user", "content": " hi ", "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "x": "é"}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "Done.", "thinking": "easy"},
    {"role": "user", "content": "never shown (break)"},
]
TOOLS = [{"name": "f", "description": "a tool", "parameters": {"z": 1, "a": 2}}]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_the_template_environment_is_transformers(folders, add_generation_prompt):
    tok, ref = bl.load_tokenizer(folders["llama"]), hf(folders["llama"])
    kw = dict(
        chat_template=RICH_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        tools=TOOLS,
        enable_thinking=False,
    )
    got = tok.apply_chat_template(RICH_CHAT, **kw)
    assert got == ref.apply_chat_template(RICH_CHAT, tokenize=False, **kw)
    for needle in ("[think]easy|easy[/think]", '"a": 2', "name=ann", "no thinking"):
        assert needle in got
    assert "never shown" not in got and "style=" not in got
    assert tok.apply_chat_template(RICH_CHAT, **kw, style="terse") == (
        ref.apply_chat_template(RICH_CHAT, tokenize=False, **kw, style="terse")
    )


def test_it_is_the_tokenizer_of_generate_text(folders):
    """`generate_text` through it gives the text it gives through
    transformers' tokenizer (the same ids in, the same text out)."""
    tok, ref = bl.load_tokenizer(folders["llama"]), hf(folders["llama"])
    cfg = bl.DecoderConfig.llama(tok.vocab_size, 16, 2, 1, num_kv_heads=1, max_len=32)
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    prompts = ["The café 🙂", " leading"]
    got = bl.generate_text(model, tok, prompts, 5)
    assert got == bl.generate_text(model, ref, prompts, 5)
    assert got[0].startswith("<s>") and "The café 🙂" in got[0]  # BOS, written


def _copy(src: Path, dst: Path, *, config=None, tokenizer_json=None, files=(), drop=()):
    """`src` copied to `dst` with `config` merged into tokenizer_config.json,
    `tokenizer_json` into tokenizer.json, `files` written, `drop` removed."""
    shutil.copytree(src, dst)
    for name, update in (
        ("tokenizer_config.json", config),
        ("tokenizer.json", tokenizer_json),
    ):
        if update:
            data = json.loads((dst / name).read_text(encoding="utf-8"))
            (dst / name).write_text(json.dumps({**data, **update}), encoding="utf-8")
    for name, text in dict(files).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text, encoding="utf-8")
    for name in drop:
        (dst / name).unlink()
    return dst


def _wordpiece(dst: Path) -> Path:
    """A WordPiece folder whose decoder leaves spaces before punctuation and
    whose config asks to clean them up (applied: not a BPE model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    ).save_pretrained(dst)
    return dst


TOKEN = {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False}
TOOL_USE = "T{{ tools | tojson }}{{ messages[-1]['content'] }}"
VARIANTS = {
    # transformers 4.x folders: the template inside tokenizer_config.json
    "template in the config": dict(
        config={"chat_template": LLAMA_TEMPLATE}, drop=["chat_template.jinja"]
    ),
    "named templates in the config": dict(
        config={
            "chat_template": [
                {"name": "default", "template": LLAMA_TEMPLATE},
                {"name": "tool_use", "template": TOOL_USE},
            ]
        },
        drop=["chat_template.jinja"],
    ),
    "named template files": dict(
        files={"additional_chat_templates/tool_use.jinja": TOOL_USE}
    ),
    # special_tokens_map.json overrides the config without added_tokens_decoder
    "special_tokens_map.json": dict(
        files={
            "special_tokens_map.json": json.dumps(
                {"eos_token": TOKEN, "pad_token": "</s>"}
            )
        }
    ),
    "special_tokens_map.json ignored": dict(
        config={"added_tokens_decoder": {"0": {**TOKEN, "special": True}}},
        files={"special_tokens_map.json": json.dumps({"eos_token": "<unk>"})},
    ),
    # special tokens the vocabulary lacks get new ids; *_token names are variables
    "new special tokens": dict(
        config={
            "pad_token": "<pad2>",
            "boi_token": "<boi>",
            "extra_special_tokens": ["<x1>", "<s>"],
        },
        files={"chat_template.jinja": "{{ boi_token }}{{ messages[0]['content'] }}"},
    ),
    # transformers 5 ignores add_bos_token when tokenizer.json is there
    "add_bos_token false": dict(config={"add_bos_token": False}),
    "no post-processor": dict(
        config={"add_bos_token": True}, tokenizer_json={"post_processor": None}
    ),
    "split_special_tokens": dict(config={"split_special_tokens": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS) + ["BPE clean-up", "WordPiece"])
def test_older_and_edited_folders_read_as_transformers_reads_them(
    folders, tmp_path, variant
):
    if variant == "WordPiece":
        folder = _wordpiece(tmp_path / "wp")
    elif variant == "BPE clean-up":  # asked for, but not applied to a BPE model
        folder = _copy(
            folders["gpt2"],
            tmp_path / "v",
            config={"clean_up_tokenization_spaces": True},
        )
    else:
        folder = _copy(folders["llama"], tmp_path / "v", **VARIANTS[variant])
    tok, ref = bl.load_tokenizer(folder), hf(folder)
    texts = [*HELD_OUT, "a , b . it 's ok ! <pad2> <x1><boi>"]
    for text in texts:
        for add in (True, False):
            ids = ref.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == ids, text
            assert tok.decode(ids) == ref.decode(ids), text
            assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True
            )
    assert dict(tok.special_tokens) == ref.special_tokens_map
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        len(ref),
    )
    if ref.chat_template is not None:
        for tools in (None, [{"name": "f"}]):
            got = tok.apply_chat_template(CHAT, tools=tools)
            assert got == ref.apply_chat_template(CHAT, tools=tools, tokenize=False)
    if "named" in variant:
        assert set(tok.chat_templates) == {"default", "tool_use"}
        got = tok.apply_chat_template(CHAT, chat_template="tool_use")
        assert got == ref.apply_chat_template(
            CHAT, chat_template="tool_use", tokenize=False
        )
    # what each variant is about, by hand
    expect = {
        "special_tokens_map.json": lambda: (
            tok.eos_id == tok.encode("<unk>", add_special_tokens=False)[0]
        ),
        "special_tokens_map.json ignored": lambda: (
            tok.special_tokens["eos_token"] == "</s>"
        ),
        "new special tokens": lambda: (
            {tok.pad_id, tok.encode("<x1>")[-1]} == {560, 562}
        ),
        "add_bos_token false": lambda: tok.adds_bos,
        "no post-processor": lambda: not tok.adds_bos,
        "split_special_tokens": lambda: (
            tok.bos_id not in tok.encode("<s>", add_special_tokens=False)
        ),
        "WordPiece": lambda: tok.decode(tok.encode("a , b .")) == "a, b.",
        "BPE clean-up": lambda: tok.decode(tok.encode("a , b .")) == "a , b .",
    }
    assert expect.get(variant, lambda: True)(), variant


def test_stop_ids_add_generation_config_eos_ids(folders, tmp_path):
    """`eos_id` is the tokenizer's EOS; `stop_ids` adds generation_config.json's
    list (Gemma's `<end_of_turn>`), as `GenerationConfig` reads it."""
    end_of_turn = bl.load_tokenizer(folders["gemma"]).encode(
        "<end_of_turn>", add_special_tokens=False
    )
    generation = {"bos_token_id": 2, "eos_token_id": [1, *end_of_turn]}
    folder = _copy(
        folders["gemma"],
        tmp_path / "g",
        files={"generation_config.json": json.dumps(generation)},
    )
    tok = bl.load_tokenizer(folder)
    ref = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    assert tok.eos_id == hf(folder).eos_token_id == 1
    assert tok.stop_ids == (1, *end_of_turn) == tuple(ref)


NO_TORCH = NO_TORCH_PRELUDE + textwrap.dedent(
    """
    import json
    import blocklab as bl

    folders, texts, chat = json.loads(sys.argv[1])
    out = {}
    for name, folder in folders.items():
        tok = bl.load_tokenizer(folder)
        ids = [tok.encode(t) for t in texts]
        out[name] = {
            "ids": ids,
            "text": [tok.decode(i) for i in ids],
            "chat": tok.apply_chat_template(chat, add_generation_prompt=True)
            if tok.chat_templates else None,
        }
    assert all(sys.modules.get(m) is None for m in ("torch", "transformers"))
    print(json.dumps(out))
    """
)


def test_without_torch_and_transformers(folders, tmp_path):
    """In a process where `import torch` and `import transformers` fail, every
    folder loads and gives transformers' ids, text and chat text."""
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH, encoding="utf-8")
    arg = json.dumps([{k: str(v) for k, v in folders.items()}, HELD_OUT, CHAT])
    code, out, err = run([sys.executable, str(script), arg], timeout=120)
    assert code == 0, err
    got = json.loads(out)
    for name, folder in folders.items():
        ref = hf(folder)
        ids = [ref.encode(t) for t in HELD_OUT]
        assert got[name]["ids"] == ids
        assert got[name]["text"] == [ref.decode(i) for i in ids]
        if name in TEMPLATED:
            want = ref.apply_chat_template(
                CHAT, add_generation_prompt=True, tokenize=False
            )
            assert got[name]["chat"] == want


# -- refusals ---------------------------------------------------------------


def test_a_folder_without_a_tokenizer_is_refused_by_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"{empty}.*no tokenizer.json.*nothing"):
        bl.load_tokenizer(empty)
    spm = tmp_path / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match="sentencepiece tokenizer.model"):
        bl.load_tokenizer(spm)
    with pytest.raises(ConfigError, match="is not a folder"):
        bl.load_tokenizer(spm / "tokenizer.model")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("tokenizer.json", '{"version": "1.0", "model": ', "not a tokenizers file"),
        ("tokenizer.json", '{"model": {"type": "Nope"}}', "not a tokenizers file"),
        ("tokenizer_config.json", "{bos_token: <s>}", "not readable JSON"),
        ("tokenizer_config.json", "[1, 2]", "must hold a JSON object"),
        ("tokenizer_config.json", '{"bos_token": 7}', "bos_token must be a token"),
        ("tokenizer_config.json", '{"chat_template": 3}', "chat_template must be"),
        ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id must be"),
    ],
)
def test_a_broken_file_is_refused_by_name(folders, tmp_path, name, text, match):
    folder = _copy(folders["llama"], tmp_path / "b", drop=["chat_template.jinja"])
    (folder / name).write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match) as info:
        bl.load_tokenizer(folder)
    assert str(folder / name) in str(info.value)


def test_an_unknown_template_variable_is_refused_by_name(folders):
    """Where transformers renders an unknown variable as empty text, blocklab
    refuses it; `is defined` and `| default` still work as there."""
    tok, ref = bl.load_tokenizer(folders["llama"]), hf(folders["llama"])
    for template in ("{{ system_name }}", "{% if system_name %}x{% endif %}"):
        with pytest.raises(ConfigError, match="'system_name', which nothing gives"):
            tok.apply_chat_template(CHAT, chat_template=template)
        assert (
            ref.apply_chat_template(CHAT, chat_template=template, tokenize=False) == ""
        )
    assert tok.apply_chat_template(CHAT, chat_template=template, system_name="x") == "x"
    lenient = "{{ system_name | default('d') }}{{ x is defined }}{{ messages[0].nope }}"
    got = tok.apply_chat_template(CHAT, chat_template=lenient)
    assert got == ref.apply_chat_template(CHAT, chat_template=lenient, tokenize=False)
    assert got == "dFalse"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% set ns = namespace(_x=1) %}", "underscore name '_x'"),
        ("{{ messages.append(1) }}", "unsafe|cannot"),
        ("{{ ''.__class__.__mro__ }}", "unsafe|__class__"),
        ("{% for %}", "does not parse"),
    ],
)
def test_a_template_that_refuses_or_escapes_is_refused(folders, template, match):
    """The sandbox and `raise_exception` refuse as in transformers (which raises
    jinja2's errors); blocklab raises a ConfigError with their message."""
    import jinja2

    tok, ref = bl.load_tokenizer(folders["llama"]), hf(folders["llama"])
    with pytest.raises(ConfigError, match=match):
        tok.apply_chat_template(CHAT, chat_template=template)
    with pytest.raises(jinja2.TemplateError):
        ref.apply_chat_template(CHAT, chat_template=template, tokenize=False)


@pytest.mark.usefixtures("plain_python")
def test_bad_arguments_are_refused_by_name(folders):
    tok = bl.load_tokenizer(folders["gpt2"])
    cases = [
        (lambda: tok.apply_chat_template(CHAT), "has no chat template"),
        (lambda: tok.apply_chat_template([], chat_template="x"), "messages is empty"),
        (lambda: tok.apply_chat_template(["hi"], chat_template="x"), r"messages\[0\]"),
        (lambda: tok.apply_chat_template("hi", chat_template="x"), "list of dicts"),
        (lambda: tok.encode(b"hi"), "text must be a str"),
        (lambda: tok.encode("hi", add_special_tokens=1), "add_special_tokens"),
        (lambda: tok.decode([1, -2]), r"ids\[1\] = -2"),
        (lambda: tok.decode(np.zeros((2, 2), int)), "flat sequence"),
        (lambda: tok.decode([1.5]), "flat sequence"),
        (lambda: bl.load_tokenizer(3), "path must be a folder path"),
    ]
    for call, match in cases:
        with pytest.raises(ConfigError, match=match):
            call()
    # an id beyond the tokenizer (a padded model vocabulary) gives no text
    ref = hf(folders["gpt2"])
    ids = [*tok.encode("ok"), tok.vocab_size + 5]
    assert tok.decode(ids) == ref.decode(ids) == "ok"
