"""The token pipeline: text files tokenized once into a memory-mapped token folder,
then packed, shuffled and resumable batches, each checked against NumPy on the
token file: every token once per epoch, the order a function of (seed, epoch,
step), `pack_documents`' segment ids, chunked reading equal to reading at once,
refusals that leave no file behind, and `train_model` on the batches."""

import hashlib
import itertools
import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.data import TokenFile, TokenPipeline, pack_documents, tokenize_files

SEP = "<|sep|>"
#: multi-byte UTF-8 (2, 3 and 4 bytes), tabs, CRLF, and pieces of the separator
WORDS = [
    "the",
    "time",
    "naïve",
    "café",
    "☃",
    "🙂",
    "Größe",
    "日本語",
    "<|",
    "\t",
    "a\r\nb",
]


class Bytes:
    """A byte tokenizer: the UTF-8 bytes of the text as ids 1..256, EOS 0."""

    eos_id = 0
    vocab_size = 257

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return [b + 1 for b in text.encode()]


class Codepoints:
    """One id per character (its code point + 1), EOS 0, no `vocab_size`."""

    eos_id = 0

    def encode(self, text):
        return [ord(c) + 1 for c in text]


class FailsOnThird(Bytes):
    """Raises on its third document, after two were written."""

    def encode(self, text):
        if self.calls == 2:
            raise RuntimeError("tokenizer failed")
        return super().encode(text)


def _texts(seed, files=3, docs=8):
    """`files` texts of `docs` documents each, joined by `SEP`."""
    rng = np.random.default_rng(seed)
    return [
        SEP.join(
            " ".join(rng.choice(WORDS, size=int(rng.integers(1, 25))))
            for _ in range(docs)
        )
        for _ in range(files)
    ]


def _write(folder, texts):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        paths.append(folder / f"part{i}.txt")
        paths[-1].write_bytes(text.encode())
    return paths


def _reference(texts, sep, tok=None):
    """The documents' ids, each ending in EOS, encoded from the whole texts."""
    tok = Bytes() if tok is None else tok
    return [
        np.array([*tok.encode(doc), tok.eos_id])
        for text in texts
        for doc in (text.split(sep) if sep else [text])
        if doc
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A token folder of 3 files x 8 documents, and its documents' ids."""
    root = tmp_path_factory.mktemp("corpus")
    texts = _texts(0)
    tf = tokenize_files(
        _write(root, texts), Bytes(), root / "tokens", separator=SEP, progress=False
    )
    return tf, _reference(texts, SEP)


def _epoch(pipe, epoch=0):
    """The windows and rows of the draws of one epoch, across batch boundaries."""
    B, N = pipe.batch_size, pipe.num_windows
    first, last = epoch * N // B, ((epoch + 1) * N - 1) // B
    ids, rows = [], []
    for step in range(first, last + 1):
        ids.append(pipe.window_ids(step))
        rows.append(np.concatenate(pipe.batch_at(step), axis=1))
    lo = epoch * N - first * B
    return np.concatenate(ids)[lo : lo + N], np.concatenate(rows)[lo : lo + N]


# ---- tokenizing ------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 7, 100, 1 << 20])
@pytest.mark.parametrize("sep", [None, SEP, " "])
def test_chunked_tokenization_equals_encoding_the_whole_text(
    tmp_path, chunk_bytes, sep
):
    texts = _texts(1)
    paths = _write(tmp_path / "src", texts)
    assert all(p.stat().st_size > 50 * chunk_bytes for p in paths) or chunk_bytes > 7
    tf = tokenize_files(
        paths,
        Bytes(),
        tmp_path / "out",
        separator=sep,
        chunk_bytes=chunk_bytes,
        progress=False,
    )
    want = _reference(texts, sep)
    np.testing.assert_array_equal(tf.tokens, np.concatenate(want))
    # a plain .npy: NumPy reads it without the memory map too
    np.testing.assert_array_equal(np.load(tf.path / "tokens.npy"), tf.tokens)
    assert isinstance(tf.tokens, np.memmap) and tf.tokens.dtype == np.uint16
    assert (tf.num_tokens, tf.num_documents) == (sum(map(len, want)), len(want))
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [(s["path"], s["bytes"], s["sha256"]) for s in meta["sources"]] == [
        (str(p), p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in paths
    ]
    assert sum(s["tokens"] for s in meta["sources"]) == tf.num_tokens
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 0


def test_ids_past_uint16_are_stored_as_uint32(tmp_path):
    text = "🙂 ☃ a"  # 🙂 is code point 128578
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    tf = tokenize_files(
        tmp_path / "a.txt", Codepoints(), tmp_path / "out", progress=False
    )
    assert tf.tokens.dtype == np.uint32 and tf.vocab_size is None
    np.testing.assert_array_equal(tf.tokens, [ord(c) + 1 for c in text] + [0])


def test_second_call_reuses_the_folder_and_a_changed_file_is_refused(tmp_path):
    paths = _write(tmp_path / "src", _texts(2))
    tok = Bytes()
    tokenize_files(paths, tok, tmp_path / "out", separator=SEP, progress=False)
    calls = tok.calls
    again = tokenize_files(paths, tok, tmp_path / "out", separator=SEP, progress=False)
    assert tok.calls == calls and again.num_tokens > 0  # nothing encoded again
    with pytest.raises(ConfigError, match="another separator.*overwrite=True"):
        tokenize_files(paths, tok, tmp_path / "out", separator=" ", progress=False)
    text = paths[1].read_bytes().decode()
    paths[1].write_bytes(text[::-1].encode())  # the same size, other bytes
    with pytest.raises(ConfigError, match="other files.*overwrite=True"):
        tokenize_files(paths, tok, tmp_path / "out", separator=SEP, progress=False)
    new = tokenize_files(
        paths, tok, tmp_path / "out", separator=SEP, overwrite=True, progress=False
    )
    texts = [p.read_bytes().decode() for p in paths]  # no newline translation
    np.testing.assert_array_equal(new.tokens, np.concatenate(_reference(texts, SEP)))
    (tmp_path / "out" / "tokens.npy").unlink()  # damaged: written again
    with pytest.raises(ConfigError, match="cannot be read.*overwrite=True"):
        tokenize_files(paths, tok, tmp_path / "out", separator=SEP, progress=False)
    again = tokenize_files(
        paths, tok, tmp_path / "out", separator=SEP, overwrite=True, progress=False
    )
    np.testing.assert_array_equal(again.tokens, new.tokens)


@pytest.mark.parametrize(
    "data, where",
    [
        (b"ab\x00\x01\x02", "a NUL byte at byte 2"),
        (b"abc\xffdef", "a byte that is not UTF-8 at byte 3"),
    ],
)
def test_a_binary_file_is_refused_by_name_and_nothing_is_written(tmp_path, data, where):
    good = _write(tmp_path, ["some text"])[0]
    bad = tmp_path / "data.bin"
    bad.write_bytes(data * 3)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=rf"data\.bin is not UTF-8 text \({where}\)"):
        tokenize_files(
            [good, bad], Bytes(), tmp_path / "out", chunk_bytes=2, progress=False
        )
    assert sorted(tmp_path.iterdir()) == before  # no folder, no temporary one


def test_a_failure_mid_write_leaves_no_partial_output(tmp_path):
    paths = _write(tmp_path / "src", _texts(3))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        tokenize_files(paths, FailsOnThird(), out, separator=SEP, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # over an earlier folder (overwrite=True): the earlier one is kept intact
    old = tokenize_files(paths[:1], Bytes(), out, separator=SEP, progress=False)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        tokenize_files(
            paths, FailsOnThird(), out, separator=SEP, overwrite=True, progress=False
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert TokenFile(out).num_tokens == old.num_tokens


def test_load_tokenizer_folder_ids_and_identity(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = _texts(4)
    backend.train_from_iterator(texts, trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"})
    )
    tok = bl.load_tokenizer(folder)
    paths = _write(tmp_path / "src", texts)
    tf = tokenize_files(paths, tok, tmp_path / "out", separator=SEP, progress=False)
    want = [
        np.array([*backend.encode(d).ids, tok.eos_id])
        for t in texts
        for d in t.split(SEP)
    ]
    np.testing.assert_array_equal(tf.tokens, np.concatenate(want))
    assert tf.meta["tokenizer"]["tokenizer_json_sha256"] == (
        hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    )


# ---- batches -----------------------------------------------------------------


@pytest.mark.parametrize("segment_ids", [True, False])
@pytest.mark.parametrize("seq_len, batch_size", [(16, 5), (7, 3), (64, 1)])
def test_every_token_is_seen_exactly_once_per_epoch(
    corpus, segment_ids, seq_len, batch_size
):
    tf, _ = corpus
    ref = np.load(tf.path / "tokens.npy")  # read whole, no memory map
    L, n = len(ref), seq_len
    pipe = TokenPipeline(
        tf, seq_len=n, batch_size=batch_size, seed=3, segment_ids=segment_ids
    )
    N = -(-(L - 1) // n) if segment_ids else (L - 1) // n
    assert pipe.num_windows == N
    for epoch in (0, 1):
        windows, rows = _epoch(pipe, epoch)
        X, Y = rows[:, :n], rows[:, n : 2 * n]
        # positions: each window once, each row the tokens at its position
        np.testing.assert_array_equal(np.sort(windows), np.arange(N))
        padded = np.concatenate([ref, np.zeros(n + 1, ref.dtype)])
        for w, x, y in zip(windows, X, Y, strict=True):
            np.testing.assert_array_equal(x, padded[w * n : w * n + n])
            np.testing.assert_array_equal(y, padded[w * n + 1 : w * n + n + 1])
        # tokens: targets are the multiset of positions 1 .. min(nN, L - 1),
        # inputs that of 0 .. min(nN, L) - 1 (padding has segment id -1)
        if segment_ids:
            X, Y = X[rows[:, 2 * n : 3 * n] >= 0], Y[rows[:, 2 * n + 1 :] >= 0]
        end = min(n * N, L - 1)
        assert Counter(Y.ravel().tolist()) == Counter(ref[1 : end + 1].tolist())
        assert Counter(X.ravel().tolist()) == Counter(ref[: min(n * N, L)].tolist())


def test_epochs_differ_in_order_not_in_content(corpus):
    pipe = TokenPipeline(corpus[0], seq_len=8, batch_size=4, seed=0)
    (w0, r0), (w1, r1) = _epoch(pipe, 0), _epoch(pipe, 1)
    assert not np.array_equal(w0, w1)
    np.testing.assert_array_equal(r0[np.argsort(w0)], r1[np.argsort(w1)])


def test_the_seed_decides_the_order(corpus):
    tf = corpus[0]

    def first(seed, k=6):
        pipe = TokenPipeline(TokenFile(tf.path), seq_len=8, batch_size=4, seed=seed)
        return np.stack([np.concatenate(b, axis=1) for b in itertools.islice(pipe, k)])

    np.testing.assert_array_equal(first(5), first(5))
    assert not np.array_equal(first(5), first(6))
    # hashed per epoch: seed 5's second epoch is not seed 6's first
    a = TokenPipeline(tf, seq_len=8, batch_size=4, seed=5)
    b = TokenPipeline(tf, seq_len=8, batch_size=4, seed=6)
    assert not np.array_equal(_epoch(a, 1)[0], _epoch(b, 0)[0])


@pytest.mark.parametrize("segment_ids", [True, False])
def test_resuming_at_step_k_gives_the_unbroken_runs_batches(corpus, segment_ids):
    tf = corpus[0]
    opts = dict(seq_len=16, batch_size=5, seed=1, segment_ids=segment_ids)
    pipe = TokenPipeline(tf, **opts)
    per_epoch = pipe.num_windows / pipe.batch_size
    assert per_epoch != int(per_epoch)  # the epoch ends inside a batch
    total = int(2.5 * per_epoch)
    unbroken = list(itertools.islice(pipe, total))
    boundary = int(per_epoch)  # the batch holding the end of epoch 0
    for k in (0, 1, boundary, boundary + 1, total - 1):
        resumed = TokenPipeline(TokenFile(tf.path), **opts).batches(start=k)
        for want, got in zip(unbroken[k:], resumed, strict=False):
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(a, b)


def test_segment_ids_hand_worked(tmp_path):
    (tmp_path / "a.txt").write_text("ab|c|def")
    tf = tokenize_files(
        tmp_path / "a.txt", Bytes(), tmp_path / "out", separator="|", progress=False
    )
    a, b, c, d, e, f = (ord(ch) + 1 for ch in "abcdef")
    np.testing.assert_array_equal(tf.tokens, [a, b, 0, c, 0, d, e, f, 0])
    pipe = TokenPipeline(tf, seq_len=3, batch_size=3)
    X, Y, S = pipe.batch_at(0)
    order = np.argsort(pipe.window_ids(0))
    np.testing.assert_array_equal(X[order], [[a, b, 0], [c, 0, d], [e, f, 0]])
    np.testing.assert_array_equal(Y[order], [[b, 0, c], [0, d, e], [f, 0, 0]])
    np.testing.assert_array_equal(S[order], [[0, 0, 0, 1], [0, 0, 1, 1], [0, 0, 0, -1]])


@pytest.mark.parametrize("seq_len", [1, 5, 32])
def test_segment_ids_agree_with_pack_documents(corpus, seq_len):
    tf, docs = corpus
    windows, segments = pack_documents(docs, seq_len, pad_id=tf.eos_id)
    pipe = TokenPipeline(tf, seq_len=seq_len, batch_size=7, seed=2)
    assert pipe.num_windows == len(windows)
    for step in range(3):
        X, Y, S = pipe.batch_at(step)
        w = pipe.window_ids(step)
        np.testing.assert_array_equal(X, windows[w, :-1])
        np.testing.assert_array_equal(Y, windows[w, 1:])
        np.testing.assert_array_equal(S, segments[w])


@pytest.mark.slow  # kept out of the default run for CI time
def test_train_model_trains_on_the_batches_and_resumes(corpus):
    tf = corpus[0]
    pipe = TokenPipeline(tf, seq_len=8, batch_size=4, seed=0)
    cfg = bl.DecoderConfig(
        vocab_size=257, num_hiddens=16, num_heads=2, num_blks=1, max_len=8
    )
    model = bl.DecoderLM(cfg, key=jax.random.key(0))

    def loss_fn(model, batch, key):
        X, Y, S = batch
        return bl.lm_loss(model, X, Y, segment_ids=S), {"X": X, "S": S}

    # one chunk length per run (each train_model call compiles its own step)
    run = dict(
        key=jax.random.key(1),
        loss_fn=loss_fn,
        run=bl.RunConfig(steps_per_call=1, progress=False),
    )
    first = bl.train_model(model, pipe, optax.adam(1e-2), 3, **run)
    # resumed at step 3: its batches continue the pipeline's from batch 3
    rest = bl.train_model(
        model, pipe.batches(start=3), optax.adam(1e-2), 2, state=first.state, **run
    )
    assert first.stopped is None and rest.stopped is None
    losses = np.concatenate([first.losses, rest.losses])
    assert losses.shape == (5,) and np.isfinite(losses).all()
    for s in range(5):
        X, _, S = pipe.batch_at(s)
        res, i = (first, s) if s < 3 else (rest, s - 3)
        np.testing.assert_array_equal(res.aux["X"][i], X)
        np.testing.assert_array_equal(res.aux["S"][i], S)
    X, Y, S = (jnp.asarray(a) for a in pipe.batch_at(0))
    want = float(bl.lm_loss(model, X, Y, segment_ids=S))
    assert losses[0] == pytest.approx(want, rel=1e-5)


def test_plain_batches_train_with_the_default_loss(corpus):
    pipe = TokenPipeline(corpus[0], seq_len=8, batch_size=4, segment_ids=False)
    cfg = bl.DecoderConfig(
        vocab_size=257, num_hiddens=16, num_heads=2, num_blks=1, max_len=8
    )
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    res = bl.train_model(
        model,
        pipe,
        optax.adam(1e-2),
        1,
        key=jax.random.key(1),
        run=bl.RunConfig(progress=False),
    )
    X, Y = (jnp.asarray(a) for a in pipe.batch_at(0))
    assert res.losses[0] == pytest.approx(float(bl.lm_loss(model, X, Y)), rel=1e-5)


@pytest.mark.slow  # kept out of the default run for CI time
def test_a_sweep_trains_every_member_on_the_pipeline(corpus, plain_python):
    """`train_sweep` takes the pipeline (a host iterable): every member trains
    step s on batch s, so each member's losses equal its own `train_model`
    run on the pipeline (same model seed, same learning rate). A host
    callable fn(key) is still refused: there is no one key to give it."""
    pipe = TokenPipeline(corpus[0], seq_len=8, batch_size=4, segment_ids=False)
    cfg = bl.DecoderConfig(
        vocab_size=257, num_hiddens=16, num_heads=2, num_blks=1, max_len=8
    )
    rates = [1e-2, 3e-3]
    res = bl.train_sweep(
        lambda k: bl.DecoderLM(cfg, key=k),
        pipe,
        3,
        model_keys=[0, 0],
        data_keys=[0, 1],
        run=bl.RunConfig(steps_per_call=2, progress=False),
        sweep=bl.SweepConfig(learning_rates=rates),
    )
    for i, lr in enumerate(rates):
        alone = bl.train_model(
            bl.DecoderLM(cfg, key=jax.random.key(0)),
            pipe,
            optax.adam(lr),
            3,
            key=jax.random.key(1),
            run=bl.RunConfig(steps_per_call=2, progress=False),
        )
        np.testing.assert_allclose(res.losses[i], alone.losses, rtol=1e-4)
    assert not np.allclose(res.losses[0], res.losses[1])
    with pytest.raises(ConfigError, match="host callable"):
        bl.train_sweep(
            lambda k: bl.DecoderLM(cfg, key=k),
            bl.host_source(lambda key: pipe.batch_at(0)),
            2,
            model_keys=[0],
            data_keys=[0],
            run=bl.RunConfig(progress=False),
            sweep=bl.SweepConfig(learning_rates=[1e-2]),
        )


# ---- refusals ----------------------------------------------------------------


def test_refusals_name_the_problem(tmp_path, corpus):
    tf = corpus[0]
    text = _write(tmp_path / "src", ["abc"])[0]
    with pytest.raises(ConfigError, match="fewer than one window"):
        TokenPipeline(tf, seq_len=tf.num_tokens, batch_size=1, segment_ids=False)
    with pytest.raises(ConfigError, match="is not a token folder"):
        TokenFile(tmp_path / "src")
    with pytest.raises(ConfigError, match="must have encode.*eos_id"):
        tokenize_files(text, bl.data.VOCAB, tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="not a text file \\(a folder\\)"):
        tokenize_files(tmp_path / "src", Bytes(), tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="gave id 300 at index 0"):
        tok = Codepoints()
        tok.vocab_size, tok.encode = 257, lambda t: [300]
        tokenize_files(text, tok, tmp_path / "out", progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="hold no document"):
        tokenize_files(tmp_path / "empty.txt", Bytes(), tmp_path / "o", progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty; pass overwrite=True"):
        tokenize_files(text, Bytes(), tmp_path / "other", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "other", "src"]
