"""Cached decoding: `blocklab.generate` against `transformers`' cached `generate`.

1. Tokens per second, greedy, `--new` (128) new tokens after a `--prompt`
   (16) token prompt, at batch 1 and 8, on a converted Llama (4 layers,
   d = 256, 8 query heads on 2 kv heads, random weights): blocklab's one
   compiled program (prefill + `lax.while_loop`) against
   `transformers.LlamaForCausalLM.generate(do_sample=False)` (its
   `DynamicCache`, SDPA attention) on the same CPU threads, timed
   round-robin (median of `--reps`). Both produce the same tokens (checked).
   Target: blocklab >= 2x. (`generate`'s default: 4 blocks, unrolled loop.)
2. Decode-step cost against position: the time of one step (a scan of 16
   steps, divided) at position 20 and at 2000, (a) in one cache of
   2048 + 16 positions (what a 2048-token generation allocates; a step reads
   the whole cache, masked) and (b) in a cache sized to the position
   (p + 16, as `generate` sizes it for a prompt of p tokens); for the public
   `decode_step` (scanned stack) and for `generate`'s unrolled loop body
   (`cache.decode_blocks`, the `_unrolled` rows). Target: the step at 2000
   costs at most 1.5x the step at 20. Reference, in the same run: the
   machine's own read bandwidth for an array of the far cache's size (a
   jitted sum), and the time it takes to read the extra cache rows once at
   that bandwidth (the floor of the extra cost at float32).
3. Depth (`--depths`, default 4 16 48): `generate` at batch 8 (16-token
   prompts, 64 new tokens) with the blocks scanned and unrolled
   (`unroll_layers`): compile seconds and run time, Llama-style models of
   d = 256 built in blocklab.
4. Text, streamed (`blocklab generate`, issue 35): the same model with a
   byte-level BPE tokenizer of its 512 ids (trained here on the Time Machine
   text with `tokenizers`), batch 1, greedy, `--new` tokens after a
   `--prompt`-token text: `blocklab.stream_text` iterated to the end (one
   compiled prefill, then one compiled step per token, each piece
   detokenized as it comes) against `transformers`' `generate` on the
   prompt's ids, timed round-robin (median of `--reps`; both warm), the
   same tokens checked. Then the command itself, `blocklab generate PATH
   --json` in a child process on the model saved with `save_pretrained`
   and the tokenizer: the decoding rate it reports (after the first token:
   compiling and prefill left out). Target: >= 2x `transformers`.
   `--stream` runs this part alone.

On a GPU the sizes stay (they are a decoding workload) and PyTorch, a CPU
build here, is left out: blocklab's figures are printed alone. Prints
human-readable lines and one JSON line. Usage: `python benchmarks/generate.py
[--reps 5] [--new 128] [--prompt 16] [--threads N] [--quick]
[--depths 4 16 48] [--stream]`; with
`--threads 1` both libraries run on one thread (XLA's intra-op pool too).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# `--threads 1` must reach XLA before jax is imported: one intra-op thread.
if "--threads" in sys.argv and sys.argv[sys.argv.index("--threads") + 1] == "1":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import blocklab  # noqa: E402
from blocklab.experiments.timing import time_round_robin as round_robin  # noqa: E402

VOCAB = 512


def hf_llama(max_len: int, *, layers=4, d=256, heads=8, kv=2, seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=688,
        num_attention_heads=heads, num_key_value_heads=kv,
        num_hidden_layers=layers, max_position_embeddings=max_len,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights of real size: continuations vary
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_((0.3 if "embed" in name else 0.1) * noise)
    return model


def llama_decoder(max_len: int, *, layers=4, d=256, heads=8, kv=2, seed=0):
    """The same model built in blocklab without torch (for a GPU run)."""
    cfg = blocklab.DecoderConfig.llama(
        VOCAB, d, heads, layers, num_kv_heads=kv, ffn_width=688, max_len=max_len
    )
    return blocklab.DecoderLM(cfg, key=jax.random.key(seed))


def time_round_robin(fns: dict, reps: int) -> dict:
    """name -> median seconds of `reps` calls, the names taken in turn."""
    return {k: t.median for k, t in round_robin(fns, reps).items()}


def tokens_per_second(ours, hf, batch, prompt, new, reps):
    ids = np.random.default_rng(batch).integers(1, VOCAB, (batch, prompt))

    def ours_generate():  # one compiled program (compiled by the first call)
        return np.asarray(jax.block_until_ready(blocklab.generate(ours, ids, new)))

    out = ours_generate()
    fns = {"blocklab": ours_generate}
    same = None
    if hf is not None:
        import torch

        tids = torch.as_tensor(ids)
        mask = torch.ones_like(tids)

        def hf_generate():
            with torch.no_grad():
                return hf.generate(
                    tids, attention_mask=mask, max_new_tokens=new,
                    do_sample=False, eos_token_id=None, pad_token_id=0,
                ).numpy()  # fmt: skip

        ref = hf_generate()
        same = bool(np.array_equal(out, ref))
        fns["transformers"] = hf_generate
    med = time_round_robin(fns, reps)
    res = {f"{k}_tok_s": batch * new / v for k, v in med.items()}
    res.update({f"{k}_s": v for k, v in med.items()})
    if hf is not None:
        res["speedup"] = med["transformers"] / med["blocklab"]
        res["same_tokens"] = same
    return res


@eqx.filter_jit
def _prefill(model, ids, max_len):
    cache = model.init_cache(ids.shape[:-1], max_len)
    return model.prefill(ids, cache)[1]


@eqx.filter_jit
def _decode(model, tokens, cache):
    """`decode_step` scanned over `tokens`: the public step, scanned stack."""

    def step(cache, token):
        logits, cache = model.decode_step(token, cache)
        return cache, logits

    return jax.lax.scan(step, cache, tokens)


@eqx.filter_jit
def _decode_unrolled(model, tokens, cache):
    """`generate`'s decode loop body (`unroll_layers=True`) scanned over
    `tokens`: blocks and caches sliced once, before the loop."""
    from blocklab.models import decoding as _cache

    blocks, state = _cache.unstack(model, cache)

    def step(state, token):
        logits, state = _cache.decode_blocks(model, blocks, token[..., None], state)
        return state, logits

    return jax.lax.scan(step, state, tokens)


def bpe_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer of exactly VOCAB ids (the last one
    `<|endoftext|>`, named nowhere: no stop id), trained on the Time Machine
    text, written to `folder` as `tokenizer.json` and
    `tokenizer_config.json`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from blocklab.data.datasets import corpus_path

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_path().read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n\n"), trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({}, f)  # no named special token: no stop id


def stream_tokens_per_second(ours, hf, prompt, new, reps) -> dict:
    """Batch 1, greedy: `stream_text` to the end against `transformers`'
    `generate` (same prompt ids, same new tokens), then the command."""
    import subprocess
    import tempfile

    from blocklab.data.datasets import corpus_path
    from blocklab.text.generation import stream_text

    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "ckpt")
        # no end token anywhere: every run writes `new` tokens
        none = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        blocklab.save_pretrained(ours, folder, token_ids=none)
        bpe_tokenizer(folder)
        tok = blocklab.load_tokenizer(folder)
        words = corpus_path().read_text(encoding="utf-8").split()
        text = " ".join(words[200:260])
        text = tok.decode(tok.encode(text)[:prompt])  # about `prompt` ids
        ids = tok.encode(text)

        def ours_stream():  # never stops early: stop_ids=() as transformers'
            stream = stream_text(ours, tok, text, new, stop_ids=())
            pieces = list(stream)
            return stream, pieces

        stream, pieces = ours_stream()  # compiles
        assert "".join(pieces) == stream.texts[0]
        fns = {"blocklab_stream": ours_stream}
        res = {"prompt_tokens": len(ids), "new": new}
        if hf is not None:
            import torch

            tids = torch.as_tensor([ids])

            def hf_generate():
                with torch.no_grad():
                    return hf.generate(
                        tids, attention_mask=torch.ones_like(tids),
                        max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=0,
                    ).numpy()  # fmt: skip

            ref = hf_generate()[0, len(ids) :].tolist()
            res["same_tokens"] = ref == stream.new_ids[0]
            fns["transformers"] = hf_generate
        med = time_round_robin(fns, reps)
        res.update({f"{k}_tok_s": new / v for k, v in med.items()})
        if hf is not None:
            res["speedup"] = med["transformers"] / med["blocklab_stream"]
        # the child inherits XLA_FLAGS (one thread with --threads 1)
        env = {**os.environ, "JAX_PLATFORMS": jax.devices()[0].platform}
        cmd = [
            sys.executable, "-m", "blocklab.cli", "generate", folder, "--prompt",
            text, "--max-new-tokens", str(new), "--json",
        ]  # fmt: skip
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        cli = json.loads(out.stdout)
        res["command"] = {
            "tok_s": cli["tokens_per_second"],
            "new_tokens": cli["new_tokens"][0],
            "stop_reason": cli["stop_reasons"][0],
            "first_token_s": cli["first_token_seconds"],
            "process_s": wall,
        }
        if hf is not None:
            speedup = cli["tokens_per_second"] / res["transformers_tok_s"]
            res["command"]["speedup"] = speedup
    return res


def depth_costs(depths, batch=8, prompt=16, new=64, reps=3) -> dict:
    """`generate` with the blocks scanned and unrolled (`unroll_layers`), on
    Llama-style models of each depth (d = 256, random weights): the seconds
    to compile the program, and the median seconds of a run."""
    from blocklab.models.generation import _generate

    out = {}
    ids = np.random.default_rng(0).integers(1, VOCAB, (batch, prompt))
    for depth in depths:
        model = llama_decoder(prompt + new, layers=depth)
        row = {}
        for label, unroll in (("scanned", False), ("unrolled", True)):
            lengths = jnp.full((batch,), prompt, jnp.int32)
            args = (
                model, jnp.asarray(ids, jnp.int32), lengths,
                None, None, None, new, None, None, jnp.int32(0), unroll, None,
            )  # fmt: skip
            t0 = time.perf_counter()
            _generate.lower(*args).lowered.compile()
            compile_s = time.perf_counter() - t0

            def run(model=model, unroll=unroll):
                return jax.block_until_ready(
                    blocklab.generate(
                        model,
                        ids,
                        new,
                        config=blocklab.GenerationConfig(unroll_layers=unroll),
                    )  # fmt: skip
                )

            run()
            med = time_round_robin({"run": run}, reps)["run"]
            row[label] = {"compile_s": compile_s, "run_s": med}
        row["speedup"] = row["scanned"]["run_s"] / row["unrolled"]["run_s"]
        out[depth] = row
        print(
            f"depth {depth}: compile {row['scanned']['compile_s']:.2f} s scanned, "
            f"{row['unrolled']['compile_s']:.2f} s unrolled; run "
            f"{1e3 * row['scanned']['run_s']:.0f} ms scanned, "
            f"{1e3 * row['unrolled']['run_s']:.0f} ms unrolled "
            f"({row['speedup']:.2f}x)",
            flush=True,
        )
    return out


def step_costs(model, sizes: dict, decode, steps=16, reps=7) -> dict:
    """Seconds per decode step at each position p (cache of `sizes[p]`),
    timed round-robin (median), so that load changes hit every position."""
    tokens = jnp.ones((steps, 1), jnp.int32)
    caches = {}
    for p, cache_len in sizes.items():
        ids = np.random.default_rng(0).integers(1, VOCAB, (1, p)).astype(np.int32)
        caches[p] = jax.block_until_ready(_prefill(model, ids, cache_len))
        jax.block_until_ready(decode(model, tokens, caches[p]))  # compile
    fns = {
        p: (lambda c=c: jax.block_until_ready(decode(model, tokens, c)))
        for p, c in caches.items()
    }
    return {p: t / steps for p, t in time_round_robin(fns, reps).items()}


def cache_bytes(cache) -> int:
    """Bytes of the keys and values a step reads (every layer, all rows)."""
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(cache.layers))


def read_bandwidth(nbytes: int, reps=7) -> float:
    """The machine's own stream-read bandwidth (bytes/s) for an array of
    `nbytes` float32 in memory: a jitted sum over it, median of `reps`
    rounds of 50 calls. The reference a cache read is measured against."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)

    def call():
        for _ in range(50):
            out = total(x)
        jax.block_until_ready(out)

    call()
    return nbytes * 50 / time_round_robin({"sum": call}, reps)["sum"]


def read_floor(model, far_len: int, near_len: int) -> dict:
    """The extra cache of a batch-1 cache of `far_len` positions over one of
    `near_len`, and the seconds the machine takes to read it once."""
    far_b, near_b = (
        cache_bytes(model.init_cache((1,), n)) for n in (far_len, near_len)
    )
    bw = read_bandwidth(far_b)
    extra = far_b - near_b
    return {
        "extra_mb": extra / 2**20,
        "read_gb_s": bw / 1e9,
        "read_floor_s": extra / bw,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="CPU threads of both libraries (1: XLA's intra-op pool too)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 1 only, 3 reps")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="only the streamed text (stream_text and blocklab generate) at batch 1",
    )
    parser.add_argument(
        "--depths",
        type=int,
        nargs="*",
        default=[4, 16, 48],
        help="depths for the scanned/unrolled comparison (none: skip it)",
    )
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    far, near, extra = 2000, 20, 16
    max_len = far + extra
    result = {"platform": platform, "threads": args.threads, "new": args.new}
    if platform == "cpu":
        import torch

        torch.set_num_threads(args.threads)
        hf = hf_llama(max_len)
        ours = blocklab.from_huggingface(hf)
    else:
        hf, ours = None, llama_decoder(max_len)
    reps = 3 if args.quick else args.reps
    r = stream_tokens_per_second(ours, hf, args.prompt, args.new, reps)
    result["stream_batch1"] = r
    line = f"streamed text, batch 1: blocklab {r['blocklab_stream_tok_s']:.0f} tok/s"
    if "speedup" in r:
        line += (
            f", transformers generate {r['transformers_tok_s']:.0f} tok/s, ratio "
            f"{r['speedup']:.2f}x (same tokens: {r['same_tokens']})"
        )
    c = r["command"]
    line += (
        f"; blocklab generate (the command) reports {c['tok_s']:.0f} tok/s after "
        f"its first token ({c['new_tokens']} tokens, first after "
        f"{c['first_token_s']:.2f} s, {c['process_s']:.1f} s in all)"
    )
    if "speedup" in c:
        line += f", {c['speedup']:.2f}x transformers"
    print(line, flush=True)
    if args.stream:
        print(json.dumps(result))
        return
    for batch in (1,) if args.quick else (1, 8):
        r = tokens_per_second(ours, hf, batch, args.prompt, args.new, reps)
        result[f"batch{batch}"] = r
        line = f"batch {batch}: blocklab {r['blocklab_tok_s']:.0f} tok/s"
        if "speedup" in r:
            line += (
                f", transformers {r['transformers_tok_s']:.0f} tok/s, "
                f"ratio {r['speedup']:.2f}x (same tokens: {r['same_tokens']})"
            )
        print(line, flush=True)
    shared = {near: max_len, far: max_len}
    sized = {near: near + extra, far: far + extra}
    for label, sizes, decode in (
        ("shared_cache", shared, _decode),
        ("sized_cache", sized, _decode),
        ("shared_cache_unrolled", shared, _decode_unrolled),
        ("sized_cache_unrolled", sized, _decode_unrolled),
    ):
        costs = step_costs(ours, sizes, decode, steps=extra, reps=reps + 2)
        ratio = costs[far] / costs[near]
        result[label] = {
            "step_ms_at_20": 1e3 * costs[near],
            "step_ms_at_2000": 1e3 * costs[far],
            "ratio": ratio,
        }
        line = (
            f"decode step ({label}): {1e3 * costs[near]:.2f} ms at 20, "
            f"{1e3 * costs[far]:.2f} ms at 2000, ratio {ratio:.2f}"
        )
        if label.startswith("sized"):
            floor = read_floor(ours, sizes[far], sizes[near])
            extra_s = costs[far] - costs[near]
            at_floor = (costs[near] + floor["read_floor_s"]) / costs[near]
            result[label].update(
                extra_cache_mb=floor["extra_mb"],
                read_gb_s=floor["read_gb_s"],
                read_floor_ms=1e3 * floor["read_floor_s"],
                extra_over_floor=extra_s / floor["read_floor_s"],
                ratio_at_floor=at_floor,
            )
            line += (
                f"; {floor['extra_mb']:.1f} MB more cache, read at "
                f"{floor['read_gb_s']:.1f} GB/s in "
                f"{1e3 * floor['read_floor_s']:.2f} ms: the extra "
                f"{1e3 * extra_s:.2f} ms is "
                f"{extra_s / floor['read_floor_s']:.2f}x that floor "
                f"(ratio at the floor: {at_floor:.2f})"
            )
        print(line, flush=True)
    if args.depths and not args.quick:
        result["depth"] = depth_costs(args.depths, reps=reps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
