"""Whisper-tiny-shaped model against `transformers`: forward and greedy decoding.

A random-weight `WhisperForConditionalGeneration` of Whisper tiny's shape
(d = 384, 6 heads, FFN 1536, 4 + 4 layers, 80 mel bins over 3000 frames,
1500 encoder positions, vocab 51865), converted with
`blocklab.from_huggingface` (float32), on the same inputs and the same CPU
threads (`--threads`, default all):

1. the encoder (convolutions, positions, 4 layers) on a batch of features;
2. the teacher-forced forward (encoder and decoder) with a 4-token prompt;
3. greedy decoding of `--new` tokens after that prompt at batch 1:
   blocklab's `EncoderDecoderLM.greedy` (one compiled loop of cached steps)
   against an argmax loop on `transformers`' forward with its cache (the
   encoder once, one token per step; `generate` would add Whisper's
   special-token rules).

Timing and the alternating blocks are `benchmarks/encoders.py`'s (medians and
best rounds, compile time excluded). Also checks that the outputs agree
(max |diff| / scale, equal tokens). Prints one JSON object. Usage:
`python benchmarks/whisper.py [--batch 2] [--new 20] [--reps 5] [--threads N]`.
"""

from __future__ import annotations

import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
# encoders.py sets the threads and keeps this folder off sys.path (its
# `signal.py` would shadow the standard library's); its helpers are reused
_spec = importlib.util.spec_from_file_location(
    "_bench_encoders", os.path.join(_HERE, "encoders.py")
)
_enc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_enc)

import argparse  # noqa: E402
import json  # noqa: E402

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import blocklab  # noqa: E402

_PROMPT = [50258, 50259, 50359, 50363]  # start, English, transcribe, no timestamps


def _whisper():
    cfg = transformers.WhisperConfig(
        vocab_size=51865, num_mel_bins=80, d_model=384, encoder_layers=4,
        decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
        encoder_ffn_dim=1536, decoder_ffn_dim=1536, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=50258,
        eos_token_id=None, pad_token_id=50257,  # no end: every step runs
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.WhisperForConditionalGeneration(cfg).eval()
    return hf, blocklab.from_huggingface(hf)


def encoder(hf, ours, x, reps: int) -> dict:
    t, j = torch.tensor(x), jnp.asarray(x)
    enc = eqx.filter_jit(lambda m, f: m.encode(f))

    def ours_fn():
        return enc(ours, j).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            return hf.model.encoder(t).last_hidden_state

    out = {"config": dict(batch=len(x), frames=x.shape[-1], layers=4, d=384)}
    out["max_rel_diff"] = _enc._rel(ours_fn(), torch_fn().numpy())
    out.update(_enc._race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    return out


def forward(hf, ours, x, reps: int) -> dict:
    tgt = np.tile(np.array(_PROMPT), (len(x), 1))
    t = dict(input_features=torch.tensor(x), decoder_input_ids=torch.tensor(tgt))
    j = (jnp.asarray(x), jnp.asarray(tgt))
    fwd = eqx.filter_jit(lambda m, f, d: m(f, d))

    def ours_fn():
        return fwd(ours, *j).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            return hf(**t).logits

    out = {"config": dict(batch=len(x), layers="4+4", tgt=len(_PROMPT))}
    out["max_rel_diff"] = _enc._rel(ours_fn(), torch_fn().numpy())
    out.update(_enc._race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    return out


def greedy(hf, ours, x, new: int, reps: int) -> dict:
    x = x[:1]
    prompt = np.array([_PROMPT])
    j_x, j_prompt = jnp.asarray(x), jnp.asarray(prompt)

    def ours_fn():
        return ours.greedy(j_x, new, prompt_ids=j_prompt).block_until_ready()

    def torch_fn():
        with torch.no_grad():
            enc = hf.model.encoder(torch.tensor(x)).last_hidden_state
            ids, cache, out = torch.tensor(prompt), None, []
            for _ in range(new):
                step = hf(
                    encoder_outputs=(enc,), decoder_input_ids=ids, cache=cache,
                    use_cache=True,
                )  # fmt: skip
                cache = step.cache
                ids = step.logits[:, -1].argmax(-1, keepdim=True)
                out.append(ids)
            return torch.cat(out, dim=1)

    out = {"config": dict(batch=1, prompt=len(_PROMPT), new_tokens=new)}
    out["tokens_equal"] = bool(
        np.array_equal(np.asarray(ours_fn()), torch_fn().numpy())
    )
    out.update(_enc._race({"blocklab": ours_fn, "pytorch": torch_fn}, reps))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--new", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, help="CPUs for both libraries")
    args = parser.parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    hf, ours = _whisper()
    x = np.random.default_rng(0).normal(size=(args.batch, 80, 3000))
    x = x.astype(np.float32)
    result = {
        "threads": threads,
        "whisper_tiny_encoder": encoder(hf, ours, x, args.reps),
        "whisper_tiny_forward": forward(hf, ours, x, args.reps),
        "whisper_tiny_greedy": greedy(hf, ours, x, args.new, args.reps),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
