"""Perplexity: `blocklab.evaluate_text` against the `transformers` sliding-window loop.

A random-weight Llama (4 layers, d = 256, 8 query heads on 2 kv heads,
`--max-len` 256 positions) with a byte-level BPE tokenizer of `--vocab`
(4096) tokens trained here on the Time Machine text (nothing downloads),
saved as one checkpoint folder. The text scored is the first `--chars`
(60 000) characters of the corpus, one document.

For each (seq_len, stride) of `--windows` (default 256/128 and 256/256):

- blocklab: `load_tokenizer(folder)` + `evaluate_text(model, tokenizer, text,
  seq_len=, stride=)` on the model `load_pretrained(folder)` read (encoding
  included; the compiled programs are warmed once, as a long evaluation
  amortizes them);
- `transformers`: `AutoTokenizer(folder)(text)` and the loop of the guide
  "Perplexity of fixed-length models" (`LlamaForCausalLM.from_pretrained`,
  SDPA, `torch.no_grad`, one window per call, `labels=` with -100 on the
  context), on the same CPU threads.

Both are timed round-robin (median of `--reps`), and the summed NLL of the
two is compared (the guide's loop with each window's loss times the labels it
averaged over: see `blocklab.text.evaluate`). Target: blocklab >= 1.5x.

On a GPU, PyTorch (a CPU build here) is left out: blocklab's figures are
printed alone. Prints human-readable lines and one JSON line. Usage:
`python benchmarks/evaluate.py [--reps 5] [--threads N] [--chars 60000]
[--windows 256/128 256/256] [--batch-size 8] [--quick]`; with `--threads N`
both libraries run on the first N CPUs (1: XLA's intra-op pool too).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# `--threads N` must reach the process before jax and torch start their
# thread pools: both then run on the first N CPUs.
if "--threads" in sys.argv:
    _n = int(sys.argv[sys.argv.index("--threads") + 1])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:_n])
    if _n == 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

import blocklab  # noqa: E402
from blocklab.data.datasets import corpus_path  # noqa: E402
from blocklab.experiments.real_text import train_bpe  # noqa: E402
from blocklab.experiments.timing import time_round_robin as round_robin  # noqa: E402
from blocklab.nn.attention import with_attention_impl  # noqa: E402
from blocklab.text.evaluate import evaluate_text  # noqa: E402


def build_folder(folder: Path, vocab: int, max_len: int, seed: int = 0) -> None:
    """A random-weight Llama and a byte-level BPE tokenizer, saved in `folder`."""
    import torch
    import transformers

    text = corpus_path().read_text(encoding="utf-8")
    tok = train_bpe(text, vocab, special_tokens=["<s>", "</s>"], bos="<s>")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    hf_tok.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=256, intermediate_size=688,
        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
        max_position_embeddings=max_len, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights of real size: the context matters
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_((0.3 if "embed" in name else 0.1) * noise)
    model.save_pretrained(folder)


def guide_loop(model, tokenizer, text, max_length, stride):
    """The guide's loop; returns (NLL over the labels each loss averaged
    over, their count)."""
    import torch

    encodings = tokenizer(text, return_tensors="pt")
    seq_len = encodings.input_ids.size(1)
    nll_sum, n_tokens = 0.0, 0
    prev_end_loc = 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings.input_ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
        scored = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(outputs.loss) * scored
        n_tokens += scored
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


def time_round_robin(fns: dict, reps: int) -> dict:
    """name -> median seconds of `reps` calls, the names taken in turn."""
    return {k: t.median for k, t in round_robin(fns, reps).items()}


def measure(folder, text, seq_len, stride, batch_size, reps, hf) -> dict:
    loaded = blocklab.load_pretrained(folder)
    models = {  # as loaded ("auto": the reference kernel below 1024 keys), fused
        "blocklab": loaded,
        "blocklab_fused": with_attention_impl(loaded, "fused"),
    }

    def ours(model):
        tokenizer = blocklab.load_tokenizer(folder)
        return evaluate_text(
            model, tokenizer, text, seq_len=seq_len, stride=stride,
            batch_size=batch_size,
        )  # fmt: skip

    row, fns = {"seq_len": seq_len, "stride": stride}, {}
    for name, model in models.items():
        t0 = time.perf_counter()
        result = ours(model)  # compiles
        row[f"{name}_first_call_s"] = time.perf_counter() - t0
        row[f"{name}_perplexity"] = result.perplexity
        fns[name] = lambda model=model: ours(model)
    row.update(tokens=result.tokens, windows=result.windows)
    if hf is not None:
        hf_model, hf_tok = hf
        nll, count = guide_loop(hf_model, hf_tok, text, seq_len, stride)
        row["same_tokens"] = count == result.tokens
        row["nll_rel_diff"] = abs(nll - result.nll) / abs(nll)
        args = (hf_model, hf_tok, text, seq_len, stride)
        fns["transformers"] = lambda: guide_loop(*args)
    med = time_round_robin(fns, reps)
    row.update({f"{k}_s": v for k, v in med.items()})
    row.update({f"{k}_tok_s": result.tokens / v for k, v in med.items()})
    if hf is not None:
        row["speedup"] = med["transformers"] / med["blocklab"]
        row["speedup_fused"] = med["transformers"] / med["blocklab_fused"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chars", type=int, default=60_000)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--windows", nargs="+", default=["256/128", "256/256"],
        help="seq_len/stride pairs",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)),
        help="CPU threads of both libraries (the first N CPUs)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="10k chars, 3 reps")
    args = parser.parse_args()
    chars, reps = (10_000, 3) if args.quick else (args.chars, args.reps)
    platform = jax.devices()[0].platform
    text = corpus_path().read_text(encoding="utf-8")[:chars]
    result = {
        "platform": platform, "threads": args.threads, "chars": len(text),
        "bytes": len(text.encode()), "batch_size": args.batch_size, "rows": [],
        "load_average_before": os.getloadavg()[0],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        build_folder(folder, args.vocab, args.max_len)
        hf = None
        if platform == "cpu":
            import torch
            import transformers

            torch.set_num_threads(args.threads)
            hf = (
                transformers.LlamaForCausalLM.from_pretrained(
                    folder, attn_implementation="sdpa"
                ).eval(),
                transformers.AutoTokenizer.from_pretrained(folder),
            )
        for spec in args.windows:
            seq_len, stride = (int(x) for x in spec.split("/"))
            row = measure(folder, text, seq_len, stride, args.batch_size, reps, hf)
            result["rows"].append(row)
            line = (
                f"seq_len {seq_len}, stride {stride}: {row['tokens']} tokens in "
                f"{row['windows']} windows; blocklab {row['blocklab_s']:.3f} s "
                f"({row['blocklab_tok_s']:.0f} tok/s; first call "
                f"{row['blocklab_first_call_s']:.2f} s), with fused attention "
                f"{row['blocklab_fused_s']:.3f} s"
            )
            if hf is not None:
                line += (
                    f"; transformers {row['transformers_s']:.3f} s "
                    f"({row['transformers_tok_s']:.0f} tok/s): ratio "
                    f"{row['speedup']:.2f}x, fused {row['speedup_fused']:.2f}x "
                    f"(same tokens: {row['same_tokens']}, NLL rel. diff "
                    f"{row['nll_rel_diff']:.1e})"
                )
            print(line, flush=True)
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
