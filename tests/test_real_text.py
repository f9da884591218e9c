"""The real-text study (`blocklab.experiments.real_text`, `blocklab real-text`).

Bits per byte against hand-worked values and the uniform model's closed
form; the validation windows against a NumPy loop; the matched parameter
counts against the closed forms of both models; one tiny run end to end
through the CLI (`--json`, strict), whose saved folder `transformers` reads
back (tokenizer ids and greedy text equal to blocklab's). The slow test runs
the report's protocol with the text out and checks the finding.
"""

import contextlib
import io
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strict_json import strict_object

import blocklab as bl
from blocklab.cli import app, main
from blocklab.data.datasets import corpus_path
from blocklab.experiments import real_text as rt

TINY = rt.RealTextProtocol(
    "tiny", 12, seeds=(0, 1), bpe_vocab=300, num_hiddens=32, num_heads=2,
    num_kv_heads=1, num_blks=1, seq_len=32, batch_size=8, learning_rate=1e-2,
    warmup_steps=2, steps_per_call=6, new_tokens=8, sliding_eval=False,
)  # fmt: skip


def llama_params(V, d, H, KV, N):
    """Embedding and untied head, then per layer W_q, W_o (d x d), W_k, W_v
    (d x KV*p), SwiGLU (3 d f, f = round(8d/3)) and two RMSNorm gains; a
    final norm."""
    p, f = d // H, round(8 * d / 3)
    return 2 * V * d + N * (2 * d * d + 2 * d * KV * p + 3 * d * f + 2 * d) + d


def charlm_params(V, d, T, N):
    """Tied embedding, learned positions (T x d), per layer 4 d^2 of
    attention, SwiGLU and two norms; a final norm."""
    f = round(8 * d / 3)
    return V * d + T * d + N * (4 * d * d + 3 * d * f + 2 * d) + d


# ------------------------------------------------------------ bits per byte
def test_bits_per_byte_of_hand_worked_values():
    # 2 nats per token over 100 tokens of 350 bytes: 200 / (350 ln 2) bits per byte
    assert rt.bits_per_byte(2.0, 100, 350) == pytest.approx(0.824397, abs=1e-6)
    # bytes as tokens, uniform over 256: log2(256) = 8 bits per byte
    assert rt.bits_per_byte(math.log(256), 1000, 1000) == pytest.approx(8.0, abs=1e-12)
    # per seed and step: elementwise
    got = rt.bits_per_byte(np.array([[math.log(2), 2 * math.log(2)]]), 3, 6)
    np.testing.assert_allclose(got, [[0.5, 1.0]], rtol=1e-12)


def test_byte_tokenizer_is_the_text_s_bytes_after_the_boundary():
    tok = rt.ByteTokenizer()
    assert tok.encode("Aé") == [256, 65, 0xC3, 0xA9]
    assert tok.decode([256, 65, 0xC3, 0xA9]) == "Aé"
    assert tok.encode("x", add_special_tokens=False) == [120]


def test_validation_windows_score_every_token_once():
    ids = np.arange(100, 111)  # t_0 .. t_10
    X, Y, M = rt.validation_windows(ids, 4)
    assert X.shape == Y.shape == M.shape == (3, 4)  # ceil(10 / 4)
    targets, contexts = [], []
    for w in range(3):
        for j in range(4):
            if M[w, j]:
                targets.append(Y[w, j])
                contexts.append(X[w, j])
    np.testing.assert_array_equal(targets, ids[1:])  # t_1 .. t_10, once each
    np.testing.assert_array_equal(contexts, ids[:-1])  # each after t_{i-1}
    assert M.sum() == 10


def test_probe_of_a_uniform_model_is_log2_v_per_token():
    """Zero head: the logits are 0, the loss of every token ln V, and the
    summed loss over n targets n ln V (the probe's bits per byte is then
    n log2 V / B)."""
    cfg = bl.models.DecoderConfig.llama(50, 16, 2, 1, num_kv_heads=1, max_len=8)
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    model = eqx.tree_at(
        lambda m: m.head.weight, model, jnp.zeros_like(model.head.weight)
    )
    ids = np.random.default_rng(0).integers(0, 50, 30)
    probe = rt._ValidationProbe(*rt.validation_windows(ids, 8), chunk=2)
    np.testing.assert_allclose(float(probe(model)), 29 * math.log(50), rtol=1e-5)


@pytest.mark.slow  # the default suite's transformers comparisons run the cut too
def test_evaluate_text_cuts_first_windows_without_changing_the_score(monkeypatch):
    """`evaluate_text` runs a document's first window (scoring `seq_len - 1`
    tokens) as parts of at most `stride` scored tokens in the batches of the
    others (one compiled program, less padding). Reference: the same call
    with the windows left whole (`_merge_first_windows` the identity)."""
    from blocklab.text import evaluate as ev

    cfg = bl.models.DecoderConfig.llama(64, 16, 2, 1, num_kv_heads=1, max_len=16)
    model = bl.DecoderLM(cfg, key=jax.random.key(1))
    tok = type("Tok", (), {"encode": staticmethod(lambda t: [ord(c) % 64 for c in t])})
    texts = ["the time machine " * 5, "a short one"]  # 85 and 11 tokens
    w = ev._windows([85, 11], 16, 6)
    cut = ev._merge_first_windows(w, 6, 8)
    assert len(cut["doc"]) > len(w["doc"])  # the first windows are cut here
    assert (cut["count"] <= 6).all()
    got = bl.evaluate_text(model, tok, texts, seq_len=16, stride=6, batch_size=8)
    monkeypatch.setattr(ev, "_merge_first_windows", lambda w, rows, b: w)
    want = bl.evaluate_text(model, tok, texts, seq_len=16, stride=6, batch_size=8)
    assert got.tokens == want.tokens and got.windows == want.windows
    for a, b in zip(got.documents, want.documents, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.nll, b.nll, rtol=1e-6)


# -------------------------------------------------------- parameter counts
def test_matched_width_is_the_closest_charlm_by_the_closed_forms():
    p = TINY
    width, char, bpe = rt.matched_width(p)
    assert bpe == llama_params(300, 32, 2, 1, 1) == 30528
    assert char == charlm_params(257, width, 32, 1)
    assert width % p.num_heads == 0
    gaps = {w: abs(charlm_params(257, w, 32, 1) - bpe) for w in (width - 2, width + 2)}
    assert all(abs(char - bpe) <= g for g in gaps.values())
    q_width, q_char, q_bpe = rt.matched_width(rt.QUICK)
    assert q_bpe == llama_params(512, 64, 4, 2, 2)
    assert abs(q_char - q_bpe) / q_bpe < 0.05


def test_split_corpus_cuts_at_a_paragraph():
    text = corpus_path().read_text(encoding="utf-8")
    train, val = rt.split_corpus(text, 0.1)
    assert train + val == text and train.endswith("\n\n")
    assert 0.08 < len(val) / len(text) < 0.12


def test_train_bpe_special_tokens_and_bos():
    """The special tokens take the first ids, in order, the 256 byte symbols
    follow (every string encodes and decodes back); `bos` goes before every
    text and `bos=None` puts nothing there; several texts train one
    tokenizer."""
    text = corpus_path().read_text(encoding="utf-8")[:20_000]
    default = rt.train_bpe(text, 300)
    assert default.token_to_id(rt.EOT) == 0
    assert default.encode("The Time").ids[0] == 0
    texts, specials = [text, "naïve café"], ["<s>", "</s>"]
    plain = rt.train_bpe(texts, 300, special_tokens=specials, bos=None)
    assert [plain.token_to_id(t) for t in specials] == [0, 1]
    assert plain.get_vocab_size() == 300
    ids = plain.encode("a naïve Traveller").ids
    assert 0 not in ids and plain.decode(ids) == "a naïve Traveller"
    with_bos = rt.train_bpe(texts, 300, special_tokens=specials, bos="<s>")
    assert with_bos.encode("a naïve Traveller").ids == [0, *ids]


# ------------------------------------------------------------------ a run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`blocklab real-text --protocol quick --save DIR --no-transformers
    --json`, the quick protocol replaced by `TINY`."""
    tmp = tmp_path_factory.mktemp("real_text")
    mp = pytest.MonkeyPatch()
    mp.setitem(rt.PROTOCOLS, "quick", TINY)
    if "real_text" not in app.COMMANDS:  # until the study is registered
        mp.setattr(app, "COMMANDS", (*app.COMMANDS, "real_text"))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            status = main([
                "real-text", "--protocol", "quick", "--save", str(tmp / "model"),
                "--out", str(tmp), "--no-transformers", "--no-progress", "--json",
            ])  # fmt: skip
    finally:
        mp.undo()
    assert status == 0, out.getvalue()
    return strict_object(out.getvalue()), tmp


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_cli_json_of_a_tiny_run(tiny_run):
    data, tmp = tiny_run
    assert data["protocol"]["steps"] == 12 and data["seeds"] == [0, 1]
    text = corpus_path().read_text(encoding="utf-8")
    val = rt.split_corpus(text, 0.1)[1]
    assert data["val_bytes"] == len(val.encode("utf-8"))
    bpe, char = data["models"]["bpe"], data["models"]["char"]
    assert bpe["params"] == 30528
    assert char["params"] == charlm_params(257, data["char_width"], 32, 1)
    assert char["val_tokens"] == data["val_bytes"]  # one token per byte
    assert data["probe_steps"] == [0, 6, 12]
    curves = {m: np.asarray(data["curve_bits_per_byte"][m]) for m in ("bpe", "char")}
    assert curves["bpe"].shape == curves["char"].shape == (2, 3)
    # step 0: the byte model's logits are about 0 (embeddings of sd 0.02,
    # tied head), so its bits per byte are about log2(257) = 8.006
    np.testing.assert_allclose(curves["char"][:, 0], math.log2(257), rtol=0.02)
    for m, c in curves.items():
        assert (c[:, -1] < c[:, 0] - 1.0).all(), m  # both learned
        final = np.asarray(data["models"][m]["val_bits_per_byte"]["per_seed"])
        assert (final < 8.0).all() and (final > 1.0).all(), m
        np.testing.assert_array_equal(final, c[:, -1])  # without sliding_eval
        loss = np.asarray(data["models"][m]["val_loss_per_token"])
        tokens = data["models"][m]["val_tokens"]
        np.testing.assert_allclose(
            rt.bits_per_byte(loss, tokens, data["val_bytes"]), final, rtol=1e-9
        )
    for m in ("bpe", "char"):  # epochs: steps x batch x seq_len / training tokens
        want = 12 * 8 * 32 / data["models"][m]["train_tokens"]
        assert data["models"][m]["epochs"] == pytest.approx(want, rel=1e-12)
        best = data["models"][m]["best_on_curve"]
        i = data["probe_steps"].index(best["step"])
        assert np.mean(curves[m][:, i]) == np.min(np.mean(curves[m], 0))
    assert (
        data["models"]["char"]["train_tokens"]
        == len(rt.split_corpus(text, 0.1)[0].encode("utf-8")) + 2
    )  # the bytes, the leading EOT and the closing one
    assert data["transformers_same"] is None
    assert data["greedy"].startswith(rt.EOT + TINY.prompt)
    assert data["folder"] == str(tmp / "model")
    names = {p.name for p in (tmp / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json"} <= names  # fmt: skip
    assert [p.split("/")[-1] for p in data["figures"]] == ["real_text_bpb.png"]
    assert (tmp / "real_text_bpb.png").stat().st_size > 0


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_transformers_reads_the_saved_folder_with_equal_greedy_text(tiny_run):
    """`transformers` (AutoTokenizer, AutoModelForCausalLM) on the folder the
    run saved: the same ids on held-out strings, and greedy `generate` gives
    the text blocklab gave (in the run, and here again)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    data, tmp = tiny_run
    folder = tmp / "model"
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = bl.load_tokenizer(folder)
    for s in [
        "The Time Traveller",
        " leading  spaces\n",
        "café ✓ 🙂",
        "a<|endoftext|>b",
    ]:
        assert ours.encode(s) == hf_tok(s).input_ids, s
        assert ours.decode(ours.encode(s)) == hf_tok.decode(hf_tok(s).input_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = hf_tok(TINY.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=TINY.new_tokens,
                          attention_mask=torch.ones_like(ids))  # fmt: skip
    hf_text = hf_tok.decode(out[0])
    assert out.shape[1] == ids.shape[1] + TINY.new_tokens  # no early stop
    model = bl.load_pretrained(folder)
    assert bl.generate_text(model, ours, TINY.prompt, TINY.new_tokens) == hf_text
    assert data["greedy"] == hf_text
    assert (
        rt.transformers_greedy(folder, TINY.prompt, TINY.new_tokens) == out[0].tolist()
    )


def test_cli_refuses_bad_arguments_before_any_work(capsys, monkeypatch):
    if "real_text" not in app.COMMANDS:
        monkeypatch.setattr(app, "COMMANDS", (*app.COMMANDS, "real_text"))
    assert main(["real-text", "--seeds", "1", "1", "--json"]) == 2
    assert "must be distinct" in strict_object(capsys.readouterr().out)["error"]
    assert main(["real-text", "--steps", "0", "--json"]) == 2
    assert "--steps must lie in" in strict_object(capsys.readouterr().out)["error"]
    assert main(["real-text", "--prompt", "", "--json"]) == 2
    assert "prompt" in strict_object(capsys.readouterr().out)["error"]


def test_report_estimates():
    q = rt.report_estimate(quick=True, full=False)
    assert 0 < q <= 30
    assert rt.estimate_seconds(rt.CPU) > q
    assert rt.report_estimate(quick=False, full=True) > q


@pytest.mark.slow  # about 60 s
def test_report_protocol_with_text_out():
    """The report's protocol with the sliding-window evaluation and the text
    out: the BPE model is below the byte model in bits per byte at the same
    parameters and steps, both far below the uniform 8 bits, and the saved
    folder's greedy text in `transformers` equals blocklab's."""
    pytest.importorskip("transformers")
    r = rt.run_real_text(
        rt.QUICK.replace(sliding_eval=True, text_out=True), check_transformers=True
    )
    assert (r.val_bpb["bpe"] < r.val_bpb["char"] - 0.3).all()
    for m in rt.MODELS:
        # the sliding window (evaluate_text, stride seq_len / 2) against the
        # disjoint windows of the curve: two computations of one quantity,
        # with more context in the first
        assert (r.val_bpb[m] <= r.curve[m][:, -1] + 1e-3).all(), m
        np.testing.assert_allclose(r.val_bpb[m], r.curve[m][:, -1], rtol=0.05)
    assert (r.val_bpb["char"] < 5.0).all() and (r.val_bpb["bpe"] > 1.5).all()
    assert r.transformers_same is True
    assert r.transformers_text == r.greedy
    assert "bits per byte" in rt.report_section.__doc__
