"""`blocklab generate`: a checkpoint folder's model and tokenizer, text streamed.

The folder is built here: the chain model of `test_streaming.py` (greedy, it
writes " 🦀ж" and then the prompt's last token `at`, over and over: an emoji
of 4 byte tokens and a 2-byte character), saved with `save_pretrained`, and
the Llama-style byte-fallback tokenizer beside it, whose
`generation_config.json` lists `at` as an end token: so a greedy run of
`--prompt "the cat sat"` prints " 🦀ж" and stops. The references are the
tokenizer's decoding of the ids (worked out by hand from the cycle) and
`stream_text` called directly. Every run but one is in process
(`blocklab.cli.app.main`); one runs `python -m blocklab.cli` in a process
where `import torch` and `import transformers` fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap

import jax
import pytest
from _procs import NO_TORCH_PRELUDE, run  # noqa: E402
from strict_json import strict_object
from test_streaming import chain_model, write_tokenizer

import blocklab as bl
from blocklab.cli import app as cli
from blocklab.text import generation as text_module
from blocklab.text.generation import stream_text

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The checkpoint folder, and the ids of the chain after PROMPT."""
    root = tmp_path_factory.mktemp("generate")
    tok = bl.load_tokenizer(write_tokenizer(root / "tok", "llama"))
    last = tok.encode(PROMPT)[-1]
    cycle = [last, *tok.encode("🦀ж", add_special_tokens=False)]
    model = chain_model(tok.vocab_size, cycle)
    path = root / "ckpt"
    eos = {"bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, last]}
    bl.save_pretrained(model, path, token_ids=eos)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "tok" / name, path / name)
    return path, cycle


def main_json(argv, capsys):
    status = cli.main(["generate", *[str(a) for a in argv], "--json"])
    captured = capsys.readouterr()
    return status, strict_object(captured.out), captured.err


def test_the_text_streams_to_stdout_and_the_rate_to_stderr(folder, capsys):
    path, cycle = folder
    assert cli.main(["generate", str(path), "--prompt", PROMPT]) == 0
    out, err = capsys.readouterr()
    assert out == " 🦀ж\n"  # then `at`, an end token of generation_config.json
    assert f"new tokens: {len(cycle)} (stop_id)" in err and "tokens/s" in err


class Recorder:
    """A stdout that records what is written and where it is flushed."""

    def __init__(self):
        self.events = []

    def write(self, text):
        self.events.append(("write", text))
        return len(text)

    def flush(self):
        self.events.append(("flush", None))


def test_each_piece_is_flushed_as_it_comes(folder, monkeypatch):
    path, _ = folder
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["generate", str(path), "--prompt", PROMPT]) == 0
    events = out.events
    writes = [i for i, (kind, text) in enumerate(events) if kind == "write" and text]
    # byte fallback: " " with `▁`, "🦀ж" when the run of byte tokens ends
    assert [events[i][1] for i in writes] == [" ", "🦀ж", "\n"]
    for i, j in zip(writes, [*writes[1:], len(events)], strict=True):
        assert ("flush", None) in events[i:j]  # before the next piece


def test_json_holds_the_text_counts_reasons_and_rate(folder, capsys):
    path, cycle = folder
    status, obj, _ = main_json([path, "--prompt", PROMPT], capsys)
    assert status == 0
    tok = bl.load_tokenizer(path)
    ids = tok.encode(PROMPT)
    want = tok.decode(ids + cycle[1:])[len(tok.decode(ids)) :]
    assert obj["texts"] == [want] == [" 🦀ж"]
    assert obj["new_tokens"] == [len(cycle)] and obj["stop_reasons"] == ["stop_id"]
    assert obj["tokens_per_second"] > 0 and obj["seconds"] > 0
    assert obj["sampling"] is None and obj["interrupted"] is False


def test_max_new_tokens_ends_the_text(folder, capsys):
    path, cycle = folder
    status, obj, _ = main_json(
        [path, "--prompt", PROMPT, "--max-new-tokens", 3], capsys
    )
    assert status == 0
    assert obj["new_tokens"] == [3] and obj["stop_reasons"] == ["max_new_tokens"]
    # `▁` and two of the emoji's bytes: decoded as transformers decodes them
    tok = bl.load_tokenizer(path)
    ids = tok.encode(PROMPT)
    assert obj["texts"] == [tok.decode(ids + cycle[1:4])[len(tok.decode(ids)) :]]
    assert obj["texts"] == [" \ufffd\ufffd"]


PROMPTS = ["the cat sat", "sat on the mat and"]


def test_a_prompts_file_is_one_batch_printed_in_order(folder, capsys, tmp_path):
    path, _ = folder
    prompts = PROMPTS
    file = tmp_path / "prompts.txt"
    file.write_text(f"{prompts[0]}\n\n  \n{prompts[1]}\n", encoding="utf-8")
    status, obj, _ = main_json([path, "--prompts-file", file], capsys)
    assert status == 0 and obj["prompts"] == prompts
    tok = bl.load_tokenizer(path)
    stream = stream_text(bl.load_pretrained(path), tok, prompts, 128)
    list(stream)
    assert obj["texts"] == stream.texts and obj["stop_reasons"] == stream.stop_reasons
    assert cli.main(["generate", str(path), "--prompts-file", str(file)]) == 0
    out, _ = capsys.readouterr()
    want = f"==> prompt 1/2 <==\n{stream.texts[0]}\n==> prompt 2/2 <==\n"
    assert out == want + f"{stream.texts[1]}\n"


def test_chat_and_sampling_options_are_those_of_stream_text(folder, capsys):
    path, _ = folder
    argv = [
        path, "--prompt", "hi 🦀", "--chat", "--temperature", "0.7", "--top-k", "40",
        "--top-p", "0.9", "--seed", "3", "--max-new-tokens", 6,
    ]  # fmt: skip
    status, obj, _ = main_json(argv, capsys)
    assert status == 0
    stream = stream_text(
        bl.load_pretrained(path), bl.load_tokenizer(path), "hi 🦀", 6,
        key=jax.random.key(3), chat=True,
        config=bl.GenerationConfig(temperature=0.7, top_k=40, top_p=0.9),
    )  # fmt: skip
    list(stream)
    assert obj["texts"] == stream.texts and obj["chat"] is True
    assert obj["sampling"] == {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3}


NO_TORCH = NO_TORCH_PRELUDE + textwrap.dedent(
    """
    import runpy
    sys.argv = ["blocklab", "generate", *sys.argv[1:]]
    runpy.run_module("blocklab.cli", run_name="__main__")
    """
)


def test_it_runs_where_torch_and_transformers_cannot_be_imported(folder, tmp_path):
    path, _ = folder
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH, encoding="utf-8")
    code, out, err = run(
        [sys.executable, str(script), str(path), "--prompt", PROMPT, "--json"],
        timeout=300,
    )
    assert code == 0, err
    assert strict_object(out)["texts"] == [" 🦀ж"]


# -- Ctrl-C -------------------------------------------------------------------


@pytest.fixture
def interrupt_after_two_pieces(monkeypatch):
    real = text_module.TextStream.__next__
    count = [0]

    def next_or_interrupt(self):
        count[0] += 1
        if count[0] > 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(text_module.TextStream, "__next__", next_or_interrupt)


def test_ctrl_c_prints_the_text_so_far_as_json_with_status_130(
    folder, capsys, tmp_path, interrupt_after_two_pieces
):
    path, _ = folder
    file = tmp_path / "two.txt"
    file.write_text("\n".join(PROMPTS), encoding="utf-8")
    status, obj, _ = main_json([path, "--prompts-file", file], capsys)
    assert status == 130 and obj["interrupted"] is True
    assert "interrupted" in obj["stop_reasons"]
    assert " 🦀ж".startswith(obj["texts"][0])
    assert sum(obj["new_tokens"]) < 2 * 128


def test_ctrl_c_without_json_keeps_the_streamed_text(
    folder, capsys, interrupt_after_two_pieces
):
    path, _ = folder
    assert cli.main(["generate", str(path), "--prompt", PROMPT]) == 130
    out, err = capsys.readouterr()
    assert out == " 🦀ж\n"  # two pieces, then Ctrl-C before the stop token
    assert "interrupted" in err and "1 (interrupted)" not in err


# -- refusals -----------------------------------------------------------------


def _refusals(path, tmp_path):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"hello\x00\x01\x02")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(path, no_tok)
    (no_tok / "tokenizer.json").unlink()
    no_template = tmp_path / "no_template"
    shutil.copytree(path, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text("utf-8"))
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    no_model = tmp_path / "tokenizer_only"
    no_model.mkdir()
    shutil.copy(path / "tokenizer.json", no_model / "tokenizer.json")
    p = ["--prompt", PROMPT]
    return [
        ([path], "no prompt; give one with --prompt TEXT, or a file"),
        ([path, "--prompt", ""], "--prompt is empty"),
        ([path, *p, "--max-new-tokens", "0"], r"--max-new-tokens must lie in \[1, "),
        ([path, *p, "--temperature", "-1"], "--temperature must lie in"),
        ([path, *p, "--temperature", "1", "--top-p", "1.5"], "--top-p must lie in"),
        ([path, *p, "--temperature", "1", "--top-k", "0"], "--top-k must lie in"),
        ([path, *p, "--top-k", "5"], "--top-k 5 only applies when sampling"),
        ([path, *p, "--seed", "1"], "--seed 1 only applies when sampling"),
        ([path, *p, "--prompts-file", blank], "not allowed with argument"),
        ([tmp_path / "missing", *p], "is not a folder"),
        ([no_model, *p], "has no config.json"),
        ([no_tok, *p], "has no tokenizer.json"),
        ([no_template, *p, "--chat"], "--chat needs a chat template"),
        ([path, "--prompts-file", binary], "is a binary file"),
        ([path, "--prompts-file", latin1], r"is not UTF-8 text \(byte 0xe9"),
        ([path, "--prompts-file", blank], "holds no prompt"),
        ([path, "--prompts-file", tmp_path / "nope.txt"], "cannot be read"),
    ]


def test_bad_input_is_refused_by_name_with_status_2_and_no_file(
    folder, tmp_path, capsys, monkeypatch
):
    path, _ = folder
    cases = _refusals(path, tmp_path)
    monkeypatch.chdir(tmp_path)

    def forbidden(*_, **__):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("blocklab.interop.pretrained.load_pretrained", forbidden)
    before = sorted(os.walk(tmp_path))
    for argv, match in cases:
        status, obj, _ = main_json(argv, capsys)
        assert status == 2, (argv, obj)
        assert obj["type"] in ("ConfigError", "UsageError"), obj
        assert "generate" in obj["error"], obj["error"]
        assert re.search(match, obj["error"]), (match, obj["error"])
        assert cli.main(["generate", *[str(a) for a in argv]]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert sorted(os.walk(tmp_path)) == before  # nothing written
