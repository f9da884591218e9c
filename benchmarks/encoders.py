"""Encoders and T5 against `transformers`: forward passes and greedy decoding.

Random-weight `transformers` models, converted with `blocklab.from_huggingface`
(float32), run on the same inputs and the same CPU threads (`--threads`,
default all: both libraries are pinned to the first N CPUs):

1. BERT-base-shaped (d = 768, 12 heads, FFN 3072, vocab 30522) reduced to
   4 layers: the MLM forward of a padded (batch, seq) batch; target: at
   least parity (PyTorch / blocklab >= 1).
2. T5-small-shaped (d = 512, 8 heads, d_kv 64, FFN 2048, 6 + 6 layers,
   v1.1's gated GELU, vocab 32128): the teacher-forced forward (encoder and
   decoder); target: at least parity.
3. T5 greedy decoding of `--new` tokens at batch 1: blocklab's
   `EncoderDecoderLM.greedy` (encoder once, cross-attention keys and values
   once, one compiled loop of cached steps) against `generate(do_sample=False,
   num_beams=1)` (eos disabled on both so that both run every step);
   target: at least 2x. At batch 1 each step reads every decoder weight and
   the head once (`weights_mb_per_token`, about 174 MB in float32) for a few
   matrix-vector products: the step is bound by memory bandwidth, and
   `blocklab_weight_gb_per_s` (those bytes times the new tokens over the
   whole call, encoder included) says how close it runs to the machine's.

Each measurement alternates blocks of calls of the two libraries with a pause
between blocks (PyTorch's thread pool spins for a while after a call) and
reports medians and best rounds; compile time is excluded (a warm-up call).
Also checks that the outputs agree (max |diff| / scale, equal greedy tokens).
Prints one JSON object. Usage: `python benchmarks/encoders.py [--batch 4]
[--seq 128] [--new 32] [--reps 10] [--threads N]`.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

if "--threads" in sys.argv:
    _n = int(sys.argv[sys.argv.index("--threads") + 1])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:_n])

import argparse  # noqa: E402
import json  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import blocklab  # noqa: E402
from blocklab.experiments.timing import time_round_robin as round_robin  # noqa: E402


def _randomize(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)
    return model.eval()


def _race(cands: dict, reps: int) -> dict:
    """Median and best seconds per candidate, timed in alternating blocks."""
    for fn in cands.values():
        fn()  # warm-up (compiles blocklab's)
    t = round_robin(cands, reps, block=5 if reps >= 5 else 1, pause=0.2)
    med = {k: v.median for k, v in t.items()}
    best = {k: v.best for k, v in t.items()}
    return {
        "blocklab_ms": 1e3 * med["blocklab"],
        "pytorch_ms": 1e3 * med["pytorch"],
        "pytorch_over_blocklab": med["pytorch"] / med["blocklab"],
        "best_pytorch_over_blocklab": best["pytorch"] / best["blocklab"],
    }


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def bert(batch: int, seq: int, reps: int) -> dict:
    cfg = transformers.BertConfig(
        num_hidden_layers=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    hf = _randomize(transformers.BertForMaskedLM(cfg))
    ours = blocklab.from_huggingface(hf)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, seq))
    mask = np.ones((batch, seq), bool)
    mask[1:, seq // 2 :] = False  # padded rows
    t_ids, t_mask = torch.tensor(ids), torch.tensor(mask.astype(np.int64))
    j_ids, j_mask = jnp.asarray(ids), jnp.asarray(mask)
    fwd = eqx.filter_jit(lambda m, i, k: m(i, key_mask=k))

    def ours_fn():
        return fwd(ours, j_ids, j_mask).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            return hf(input_ids=t_ids, attention_mask=t_mask).logits

    out = {"config": dict(layers=4, d=768, heads=12, batch=batch, seq=seq)}
    out["max_rel_diff"] = _rel(np.asarray(ours_fn())[mask], torch_fn().numpy()[mask])
    out.update(_race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    return out


def _t5():
    cfg = transformers.T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
        num_heads=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        dropout_rate=0.0, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    # transformers' own T5 initialization (random, scaled per layer): with
    # uniform N(0, 0.05^2) weights and no logit scaling, 6 + 6 layers amplify
    # float32 rounding to ~3e-3 of the logits in both libraries alike
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(cfg).eval()
    # no end token, so that both decoders run every step
    hf.config.eos_token_id = hf.generation_config.eos_token_id = None
    return hf, blocklab.from_huggingface(hf)


def t5_forward(hf, ours, batch: int, seq: int, reps: int) -> dict:
    rng = np.random.default_rng(1)
    src = rng.integers(2, 32128, size=(batch, seq))
    tgt = rng.integers(2, 32128, size=(batch, seq // 2))
    mask = np.ones((batch, seq), bool)
    mask[1:, seq // 2 :] = False
    t = dict(
        input_ids=torch.tensor(src),
        attention_mask=torch.tensor(mask.astype(np.int64)),
        decoder_input_ids=torch.tensor(tgt),
    )
    j = (jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(mask))
    fwd = eqx.filter_jit(lambda m, s, t, k: m(s, t, src_mask=k))

    def ours_fn():
        return fwd(ours, *j).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            return hf(**t).logits

    out = {"config": dict(layers="6+6", d=512, heads=8, batch=batch, src=seq,
                          tgt=seq // 2)}  # fmt: skip
    out["max_rel_diff"] = _rel(ours_fn(), torch_fn().numpy())
    out.update(_race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    return out


def t5_greedy(hf, ours, seq: int, new: int, reps: int) -> dict:
    rng = np.random.default_rng(2)
    src = rng.integers(2, 32128, size=(1, seq))
    j_src = jnp.asarray(src)

    def ours_fn():
        return ours.greedy(j_src, new).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            return hf.generate(
                input_ids=torch.tensor(src), max_new_tokens=new,
                do_sample=False, num_beams=1,
            )  # fmt: skip

    out = {"config": dict(batch=1, src=seq, new_tokens=new)}
    out["tokens_equal"] = bool(
        np.array_equal(np.asarray(ours_fn()), torch_fn().numpy()[:, 1:])
    )
    out.update(_race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    # every decoder weight but the cross-attention's keys and values (their
    # products are cached), and the head
    cross = ours.decoder.blocks.cross_attn
    skip = {id(cross.W_k.weight), id(cross.W_v.weight)}
    read = [a for a in jax.tree_util.tree_leaves(eqx.filter(ours.decoder, eqx.is_array))
            if id(a) not in skip] + [ours.head_weight]  # fmt: skip
    mb = sum(a.size * a.dtype.itemsize for a in read) / 1e6
    out["weights_mb_per_token"] = mb
    out["blocklab_weight_gb_per_s"] = mb * new / out["blocklab_ms"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, help="CPUs for both libraries")
    args = parser.parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    result = {
        "threads": threads,
        "bert_4_layers": bert(args.batch, args.seq, args.reps),
    }
    hf, ours = _t5()
    result["t5_small_forward"] = t5_forward(hf, ours, args.batch, args.seq, args.reps)
    result["t5_small_greedy"] = t5_greedy(hf, ours, args.seq // 4, args.new, args.reps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
