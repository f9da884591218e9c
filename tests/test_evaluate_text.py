"""`evaluate_text` and `blocklab eval`: sliding-window perplexity and bits per byte.

The reference is the loop of the `transformers` guide "Perplexity of
fixed-length models", run in PyTorch on the same random-weight model: a tiny
Llama (BOS added by its tokenizer) and a tiny GPT-2 (no BOS), each saved as a
checkpoint folder with a byte-level BPE tokenizer trained here (nothing
downloads), and read back with `load_pretrained` + `load_tokenizer`. The
guide's loop is kept as written but for one line: a window's NLL is its mean
loss times the number of labels the loss averaged over (see
`blocklab.text.evaluate`; the guide's own count is checked apart).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.cli import app as cli
from blocklab.data.datasets import corpus_path
from blocklab.experiments.real_text import train_bpe
from blocklab.text.evaluate import evaluate_text

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hf_models import randomize  # noqa: E402
from strict_json import strict_object  # noqa: E402

MAX_LEN = 48


def _texts() -> list[str]:
    """A long document (many windows), a short one (one short window) and one
    with non-ASCII text (bytes != characters)."""
    text = corpus_path().read_text(encoding="utf-8")
    return [
        text[3000:3900],
        "The Time Traveller smiled.",
        "Le café était très bon 🙂, déjà vu — naïve. " * 3,
    ]


def _tokenizer(with_bos: bool):
    text = corpus_path().read_text(encoding="utf-8")[:30_000]
    tok = train_bpe(
        [text, *_texts()[2:]], 320, special_tokens=["<s>", "</s>"],
        bos="<s>" if with_bos else None,
    )  # fmt: skip
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )


def _build(folder, family):
    """A random-weight `transformers` model and its tokenizer, saved in `folder`."""
    hf_tok = _tokenizer(with_bos=family == "llama")
    vocab = len(hf_tok)
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            max_position_embeddings=MAX_LEN, bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_head=4, n_layer=2, n_positions=MAX_LEN,
            bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    # weights large enough that the context changes the predictions
    model = randomize(model, matrices=0.3, embeddings=1.0)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return model, hf_tok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference loop: a tiny model, no thread pool
    out = {}
    for family in ("llama", "gpt2"):
        folder = tmp_path_factory.mktemp(family)
        hf, hf_tok = _build(folder, family)
        out[family] = {
            "folder": folder,
            "hf": hf,
            "hf_tok": hf_tok,
            "model": bl.load_pretrained(folder),
            "tok": bl.load_tokenizer(folder),
        }
    yield out
    torch.set_num_threads(threads)


def guide_loop(model, encodings, max_length, stride):
    """The guide's loop (`transformers` docs, "Perplexity of fixed-length
    models"), on one document. Returns (NLL summed over the labels the loss
    averaged over, that count, the guide's own `n_tokens` and `nll_sum`, and
    the number of windows)."""
    seq_len = encodings.input_ids.size(1)
    nll_sum, n_tokens, guide_nll, guide_tokens, windows = 0.0, 0, 0.0, 0, 0
    prev_end_loc = 0
    for begin_loc in range(0, seq_len, stride):
        windows += 1
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings.input_ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
            neg_log_likelihood = outputs.loss
        # the labels the loss averages over: those past the shift's first
        scored = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(neg_log_likelihood) * scored
        n_tokens += scored
        # the guide's own accounting
        num_valid_tokens = int((target_ids != -100).sum())
        num_loss_tokens = num_valid_tokens - target_ids.size(0)
        guide_nll += float(neg_log_likelihood) * num_loss_tokens
        guide_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens, guide_tokens, guide_nll, windows


CASES = [  # (family, seq_len, stride)
    ("llama", 32, 12),  # overlapping windows
    ("llama", 24, 24),  # disjoint windows
    ("gpt2", MAX_LEN, 24),  # no BOS; the window of `blocklab eval`'s defaults
]


@pytest.mark.parametrize(("family", "seq_len", "stride"), CASES)
def test_nll_and_tokens_equal_the_transformers_sliding_window(
    checkpoints, family, seq_len, stride
):
    c = checkpoints[family]
    texts = _texts()
    got = evaluate_text(c["model"], c["tok"], texts, seq_len=seq_len, stride=stride)
    for text, doc in zip(texts, got.documents, strict=True):
        enc = c["hf_tok"](text, return_tensors="pt")
        assert c["tok"].encode(text) == enc.input_ids[0].tolist()
        assert (enc.input_ids[0, 0] == c["tok"].bos_id) == (family == "llama")
        want, count, guide_tokens, guide_nll, windows = guide_loop(
            c["hf"], enc, seq_len, stride
        )
        assert doc.tokens == count == _count(enc.input_ids.size(1), seq_len, stride)
        assert doc.nll == pytest.approx(want, rel=2e-5)
        if stride == seq_len:  # the guide's own accounting is ours
            assert (doc.tokens, doc.nll) == (guide_tokens, pytest.approx(guide_nll))
        else:  # it counts one token fewer per window after the first
            assert doc.tokens == guide_tokens + windows - 1
    assert len(c["tok"].encode(texts[1])) < seq_len  # the short one: one window
    assert got.tokens == sum(d.tokens for d in got.documents)
    assert got.nll == pytest.approx(sum(d.nll for d in got.documents), rel=1e-12)


def _count(n, seq_len, stride):
    """By hand: every token but the first is scored once when windows overlap;
    with disjoint windows the first token of each window is context only."""
    return n - math.ceil(n / seq_len) if stride == seq_len else n - 1


@pytest.mark.parametrize("n", [2, 7, 16, 17, 40, 41])
@pytest.mark.parametrize(("seq_len", "stride"), [(16, 5), (16, 15), (16, 16), (7, 1)])
def test_windows_score_each_token_once_by_hand(n, seq_len, stride):
    from blocklab.text.evaluate import _windows

    w = _windows([n], seq_len, stride)
    assert w["count"].sum() == _count(n, seq_len, stride)
    scored = np.concatenate(
        [
            b + f + 1 + np.arange(c)
            for b, f, c in zip(w["begin"], w["first_row"], w["count"], strict=True)
        ]
    )
    assert len(set(scored.tolist())) == len(scored)  # no token twice
    if stride == seq_len:  # each window's first token is context only
        want = [i for i in range(n) if i % seq_len]
    else:
        want = list(range(1, n))
    assert sorted(scored.tolist()) == want
    assert (w["length"] <= seq_len).all() and w["count"].min() >= 1
    assert (w["first_row"] >= 0).all()


def test_perplexity_and_bits_per_byte_by_hand(checkpoints):
    c = checkpoints["llama"]
    texts = _texts()
    got = evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12)
    for text, doc in zip(texts, got.documents, strict=True):
        assert doc.bytes == len(text.encode("utf-8"))
        assert doc.perplexity == pytest.approx(math.exp(doc.nll / doc.tokens))
        assert doc.bits_per_byte == pytest.approx(doc.nll / math.log(2) / doc.bytes)
    assert texts[2].encode() != texts[2].encode("latin-1", "replace")  # non-ASCII
    assert got.bytes == sum(len(t.encode("utf-8")) for t in texts)
    nll = sum(d.nll for d in got.documents)
    assert got.bits_per_byte == pytest.approx(nll / math.log(2) / got.bytes)
    assert got.perplexity == pytest.approx(math.exp(nll / got.tokens))
    out = got.to_json()
    assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert out["documents"][2]["bits_per_byte"] == got.documents[2].bits_per_byte


def test_per_tag_results_are_the_sums_of_their_documents(checkpoints):
    c = checkpoints["llama"]
    texts = _texts() + ["Another short one, with a tag of its own."]
    tags = ["prose", None, "prose", "misc"]
    got = evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12, tags=tags)
    assert list(got.tags) == ["prose", "misc"]
    d = got.documents
    prose = got.tags["prose"]
    assert (prose.tokens, prose.bytes) == (
        d[0].tokens + d[2].tokens,
        d[0].bytes + d[2].bytes,
    )
    assert prose.nll == pytest.approx(d[0].nll + d[2].nll, rel=1e-12)
    assert prose.perplexity == pytest.approx(
        math.exp((d[0].nll + d[2].nll) / (d[0].tokens + d[2].tokens))
    )
    assert got.tags["misc"] == d[3]
    assert evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12).tags == {}


@pytest.mark.parametrize("batch_size", [3, 64])
def test_batching_and_padding_do_not_change_the_result(checkpoints, batch_size):
    c = checkpoints["llama"]
    texts = _texts()
    base = evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12)
    got = evaluate_text(
        c["model"], c["tok"], texts, seq_len=32, stride=12, batch_size=batch_size
    )
    assert got.tokens == base.tokens and got.windows == base.windows
    for a, b in zip(got.documents, base.documents, strict=True):
        assert a.nll == pytest.approx(b.nll, rel=1e-5)
    one = evaluate_text(c["model"], c["tok"], texts[0], seq_len=32, stride=12)
    assert one.documents[0] == base.documents[0]


def test_the_head_in_chunks_gives_the_same_nll(checkpoints, monkeypatch):
    """A batch's rows through the head 5 at a time (the last chunk padded)."""
    from blocklab.text import evaluate as module

    c = checkpoints["llama"]
    texts = _texts()
    base = evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12)
    monkeypatch.setattr(module, "LOGITS_PER_CHUNK", 8 * 5 * c["model"].cfg.vocab_size)
    got = evaluate_text(c["model"], c["tok"], texts, seq_len=32, stride=12)
    assert got.tokens == base.tokens
    for a, b in zip(got.documents, base.documents, strict=True):
        assert a.nll == pytest.approx(b.nll, rel=1e-6)


def test_charlm_with_the_chapter_vocab_equals_a_loop_of_full_forwards():
    """A `CharLM` (no `hidden`: full logits, then the rows), against NumPy on
    each window's own forward pass."""
    import equinox as eqx
    import jax

    model = bl.CharLM(28, 16, 2, 1, max_len=24, key=jax.random.key(0))
    forward = eqx.filter_jit(model)
    text = "the time traveller (for so it will be convenient to speak of him)"
    ids = np.asarray(bl.data.VOCAB.encode(text))
    seq_len, stride = 24, 17
    want, prev = 0.0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        z = np.asarray(forward(ids[begin:end]), np.float64)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for i in range(max(prev, begin + 1), end):
            want -= logp[i - begin - 1, ids[i]]
        prev = end
        if end == len(ids):
            break
    got = evaluate_text(model, bl.data.VOCAB, text, seq_len=seq_len, stride=stride)
    assert got.tokens == len(ids) - 1
    assert got.nll == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(stride=33), "stride=33 is larger than seq_len=32"),
        (dict(stride=0), "stride must lie in"),
        (dict(seq_len=MAX_LEN + 1, stride=4), "longer than the model's max_len=48"),
        (dict(seq_len=1, stride=1), "seq_len must lie in"),
        (dict(texts=""), "texts is empty"),
        (dict(texts=["ok, fine", "!"]), r"texts\[1\] encodes to 1 token"),
        (dict(texts=[]), "non-empty"),
        (dict(texts=["a b", 3]), r"texts\[1\] must be a str"),
        (dict(tags=["a"]), "tags has 1 entries for 2 texts"),
        (dict(tags=["a", 3]), r"tags\[1\] must be"),
        (dict(batch_size=0), "batch_size must lie in"),
        (dict(model="nope"), "model must be a DecoderLM or a CharLM"),
        (dict(tokenizer=object()), "tokenizer must have an encode"),
    ],
)
def test_bad_input_is_refused_by_name(checkpoints, kwargs, match, plain_python):
    c = checkpoints["gpt2"]
    args = dict(
        model=c["model"], tokenizer=c["tok"], texts=["one text", "two texts"],
        seq_len=32, stride=16,
    )  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        evaluate_text(
            args.pop("model"), args.pop("tokenizer"), args.pop("texts"), **args
        )


def test_ids_outside_the_models_vocabulary_are_refused(checkpoints):
    class Wide:
        def encode(self, text):
            return [0, 5000]

    with pytest.raises(ConfigError, match="token id 5000 at index 1, outside"):
        evaluate_text(checkpoints["gpt2"]["model"], Wide(), "x", seq_len=8, stride=8)


# The command ---------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    texts = _texts()
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    return texts, [str(p) for p in paths]


def test_eval_json_equals_evaluate_text_and_out_is_the_same_object(
    checkpoints, files, tmp_path, capsys
):
    c = checkpoints["llama"]
    texts, paths = files
    out = tmp_path / "result.json"
    argv = [
        "eval", str(c["folder"]), "--data", paths[0], "--tag", f"fr={paths[2]}",
        "--tag", f"en={paths[1]}", "--seq-len", "32", "--stride", "12",
        "--batch-size", "3", "--json", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    got = strict_object(captured.out)
    assert "window" in captured.err  # the progress bar
    want = evaluate_text(
        c["model"], c["tok"], [texts[0], texts[2], texts[1]], seq_len=32,
        stride=12, tags=[None, "fr", "en"],
    )  # fmt: skip
    assert got["tokens"] == want.tokens and got["windows"] == want.windows
    assert got["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-5)
    assert [d["file"] for d in got["documents"]] == [paths[0], paths[2], paths[1]]
    assert [d["tag"] for d in got["documents"]] == [None, "fr", "en"]
    assert set(got["tags"]) == {"fr", "en"}
    assert got["tags"]["fr"]["tokens"] == want.tags["fr"].tokens
    assert (got["seq_len"], got["stride"], got["batch_size"]) == (32, 12, 3)
    assert strict_object(out.read_text()) == got


def test_eval_prints_a_table_and_defaults_the_window(checkpoints, files, capsys):
    _, paths = files
    assert cli.main(["eval", str(checkpoints["gpt2"]["folder"]), "--data", *paths]) == 0
    out = capsys.readouterr().out
    assert "seq_len 48, stride 24" in out  # max_len, and half of it
    assert "| total |" in out and paths[1] in out


def _binary(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(256, dtype=np.uint8).tobytes())
    return path


def _latin1(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    return path


def _empty(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("make", "extra", "match"),
    [
        (_binary, [], "weights.bin' is binary \\(a NUL byte at offset 0\\)"),
        (_latin1, [], "latin1.txt' is not UTF-8 text \\(byte 0xe9 at offset 3\\)"),
        (_empty, [], "empty.txt' is empty"),
        (None, ["--stride", "40", "--seq-len", "32"], "--stride 40 is larger than"),
        (None, ["--stride", "0"], "--stride must lie in"),
        (None, ["--seq-len", "64"], "longer than the model's max_len=48"),
        (None, ["--tag", "nofile"], "--tag takes NAME=FILE"),
    ],
)
def test_eval_refusals_are_json_errors_and_leave_no_output(
    checkpoints, files, tmp_path, capsys, make, extra, match
):
    _, paths = files
    data = [str(make(tmp_path))] if make else []
    out = tmp_path / "out.json"
    argv = ["eval", str(checkpoints["gpt2"]["folder"]), "--data", paths[0], *data]
    assert cli.main([*argv, *extra, "--json", "--out", str(out)]) == 2
    err = strict_object(capsys.readouterr().out)
    assert err["type"] == "ConfigError"
    assert __import__("re").search(match, err["error"]), err["error"]
    assert not out.exists()
    assert list(tmp_path.glob(".out.json*")) == []


def test_eval_refuses_a_folder_without_a_tokenizer(
    checkpoints, tmp_path, files, capsys
):
    import shutil

    folder = tmp_path / "no_tokenizer"
    shutil.copytree(checkpoints["gpt2"]["folder"], folder)
    (folder / "tokenizer.json").unlink()
    assert cli.main(["eval", str(folder), "--data", files[1][0], "--json"]) == 2
    err = strict_object(capsys.readouterr().out)
    assert "has no tokenizer.json" in err["error"]


def test_eval_names_an_unwritable_out_before_anything_else(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = ["eval", str(tmp_path / "nothing"), "--out", str(blocker / "r.json")]
    assert cli.main([*argv, "--json"]) == 2
    err = strict_object(capsys.readouterr().out)
    assert "--out=" in err["error"] and err["type"] == "ConfigError"
    assert blocker.read_text() == "not a folder"


def test_eval_without_data_is_refused(checkpoints, capsys):
    assert cli.main(["eval", str(checkpoints["gpt2"]["folder"]), "--json"]) == 2
    assert "no text to score" in strict_object(capsys.readouterr().out)["error"]


def test_a_failed_run_leaves_an_old_out_file_as_it_was(
    checkpoints, files, tmp_path, capsys, monkeypatch
):
    from blocklab.cli.commands import eval as command

    def fail(*args, **kwargs):
        raise OSError("disk gone mid-run")

    monkeypatch.setattr(command, "evaluate_text", fail)
    out = tmp_path / "out.json"
    out.write_text('{"old": true}\n')
    argv = ["eval", str(checkpoints["gpt2"]["folder"]), "--data", files[1][0]]
    assert cli.main([*argv, "--json", "--out", str(out)]) == 1
    assert "disk gone" in strict_object(capsys.readouterr().out)["error"]
    assert out.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "doc0.txt",
        "doc1.txt",
        "doc2.txt",
        "out.json",
    ]
