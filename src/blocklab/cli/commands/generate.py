"""`blocklab generate`: continue prompts with a checkpoint folder's model and
tokenizer, printing the text as it is generated
(`blocklab.text.generation.stream_text`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..._validate import ConfigError, check_float, check_int
from ...experiments._render import dumps
from ...training.checkpoint import CheckpointError

NAME = "generate"
HELP = (
    "continue a prompt with a checkpoint folder's model and tokenizer, printing "
    "the text as it is generated (blocklab generate PATH --prompt 'Once upon')"
)
EPILOG = (
    "Greedy by default (--temperature 0); --temperature T > 0 samples, with "
    "--top-k, --top-p and --seed (default 0). A text ends at the tokenizer's "
    "stop ids (EOS, and the eos_token_id list of generation_config.json), at "
    "--max-new-tokens, or when prompt and text fill the model's max_len. "
    "Output: the new text only, streamed to stdout as it is generated (flushed "
    "per token); with --prompts-file, all prompts are decoded as one batch, "
    "the first prompt's text streams under a '==> prompt 1/N <==' header and "
    "the others follow in order, each under its header, once the batch is "
    "done. Tokens, stop reasons and the decoding rate (tokens per second "
    "after the first token, compiling and prefill left out) go to stderr. "
    "--json prints no streamed text: one object with the texts, new_tokens, "
    "stop_reasons, tokens_per_second, first_token_seconds and seconds. Ctrl-C "
    "ends the run with the text generated so far (exit status 130; with "
    "--json, the object with stop reason 'interrupted'). Bad arguments (an "
    "empty prompt, --max-new-tokens 0, a folder without config.json or "
    "tokenizer.json, a binary prompts file) exit with status 2 before the "
    "weights are read. torch and transformers are not imported."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH",
        help="a checkpoint folder: config.json, model.safetensors (or shards) "
        "and tokenizer.json, as transformers' save_pretrained writes them",
    )  # fmt: skip
    # not required=True: argparse would name a missing prompt before an
    # unknown option; validate asks for one instead
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt", metavar="TEXT", help="the prompt (or --prompts-file)"
    )
    source.add_argument(
        "--prompts-file", metavar="FILE",
        help="a UTF-8 text file of prompts, one per line (blank lines skipped), "
        "decoded as one batch",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="N",
        help="tokens to add to each prompt at most (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T",
        help="0 (the default): greedy; T > 0: sample from softmax(logits / T)",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, default=None, metavar="K",
        help="sample among the K most likely tokens (with --temperature > 0)",
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="nucleus sampling, 0 < P <= 1 (with --temperature > 0)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=None, metavar="S",
        help="the sampling seed (with --temperature > 0; default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--chat", action="store_true",
        help="render each prompt as a user message through the folder's chat "
        "template, with the assistant's turn opened (add_generation_prompt)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    """Every argument checked, the folder's config and tokenizer read, and the
    prompts read (`args._tokenizer`, `args._prompts`): all before the weights
    are loaded."""
    from ...data.tokenizer import load_tokenizer
    from ...interop.pretrained import pretrained_config

    owner = "blocklab generate"
    check_int(owner, "--max-new-tokens", args.max_new_tokens, min=1)
    check_float(owner, "--temperature", args.temperature, min=0.0)
    if args.temperature == 0:
        given = [
            f"{flag} {value}"
            for flag, value in (
                ("--top-k", args.top_k), ("--top-p", args.top_p),
                ("--seed", args.seed),
            )
            if value is not None
        ]  # fmt: skip
        if given:
            raise ConfigError(
                f"{owner}: {', '.join(given)} only applies when sampling, and "
                "--temperature is 0 (greedy decoding); give --temperature T > 0 "
                "(e.g. 0.8) to sample, or drop it."
            )
    check_float(
        owner, "--top-p", args.top_p, min=0.0, min_open=True, max=1.0, optional=True
    )
    if args.prompt is None and args.prompts_file is None:
        raise ConfigError(
            f"{owner}: no prompt; give one with --prompt TEXT, or a file of them "
            "with --prompts-file FILE."
        )
    if args.prompt is not None:
        if not args.prompt:
            raise ConfigError(
                f"{owner}: --prompt is empty (--prompt ''); give at least one "
                "character."
            )
        args._prompts = [args.prompt]
    else:
        args._prompts = _read_prompts(owner, args.prompts_file)
    if not Path(args.path).is_dir():
        raise ConfigError(
            f"{owner}: PATH {args.path} is not a folder; give a checkpoint folder "
            "(config.json, model.safetensors, tokenizer.json)."
        )
    try:
        cfg = pretrained_config(args.path)
        args._tokenizer = tokenizer = load_tokenizer(args.path)
    except (CheckpointError, ConfigError) as e:
        raise ConfigError(f"{owner}: PATH {args.path}: {e}") from None
    check_int(owner, "--top-k", args.top_k, min=1, max=cfg.vocab_size, optional=True)
    if args.chat and not tokenizer.chat_templates:
        raise ConfigError(
            f"{owner}: --chat needs a chat template, and {args.path} has none (no "
            "chat_template.jinja, no chat_template in tokenizer_config.json); "
            "drop --chat to continue the prompt as plain text."
        )


def _read_prompts(owner: str, path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file; a missing, unreadable or
    binary file, or one without a prompt, is refused by name."""
    name = f"--prompts-file {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(
            f"{owner}: {name} cannot be read ({e.strerror or e}); give a UTF-8 "
            "text file of prompts, one per line."
        ) from None
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ConfigError(
            f"{owner}: {name} is a binary file (a NUL byte at offset {nul}); give "
            "a UTF-8 text file of prompts, one per line."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{owner}: {name} is not UTF-8 text (byte {data[e.start]:#04x} at "
            f"offset {e.start}); give a UTF-8 text file of prompts, one per line."
        ) from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(
            f"{owner}: {name} holds no prompt (it is empty or blank); write one "
            "prompt per line."
        )
    return prompts


def run(args: argparse.Namespace) -> int:
    import jax

    from ...interop.pretrained import load_pretrained
    from ...models import GenerationConfig
    from ...text.generation import stream_text

    if not hasattr(args, "_prompts"):
        validate(args)
    prompts, tokenizer = args._prompts, args._tokenizer
    sampling = args.temperature > 0
    seed = 0 if args.seed is None else args.seed
    model = load_pretrained(args.path)
    stream = stream_text(
        model, tokenizer, prompts if args.prompts_file else prompts[0],
        args.max_new_tokens, key=jax.random.key(seed) if sampling else None,
        config=GenerationConfig(
            temperature=args.temperature if sampling else 1.0,
            top_k=args.top_k, top_p=args.top_p,
        ),
        chat=args.chat,
    )  # fmt: skip
    batch = args.prompts_file is not None  # a list: (index, piece) pairs
    shown = ""  # the first prompt's text printed so far
    interrupted = False
    if not args.json and batch:
        print(_header(0, len(prompts)), flush=True)
    try:
        for item in stream:
            b, piece = item if batch else (0, item)
            if b == 0 and not args.json:
                print(piece, end="", flush=True)
                shown += piece
    except KeyboardInterrupt:
        interrupted = True
    reasons = [
        "interrupted" if r is None else r for r in stream.stop_reasons
    ]  # a prompt still running when Ctrl-C came
    rate = stream.tokens_per_second
    if args.json:
        print(
            dumps(
                {
                    "path": str(args.path),
                    "prompts": prompts,
                    "chat": args.chat,
                    "sampling": {
                        "temperature": args.temperature, "top_k": args.top_k,
                        "top_p": args.top_p, "seed": seed,
                    } if sampling else None,
                    "texts": stream.texts,
                    "new_tokens": [len(n) for n in stream.new_ids],
                    "stop_reasons": reasons,
                    "tokens_per_second": rate,
                    "first_token_seconds": stream.first_token_seconds,
                    "seconds": stream.seconds,
                    "interrupted": interrupted,
                }
            )
        )  # fmt: skip
    else:
        print(stream.texts[0][len(shown) :], flush=True)  # held back, then \n
        for b in range(1, len(prompts)):
            print(_header(b, len(prompts)))
            print(stream.texts[b], flush=True)
        counts = [len(n) for n in stream.new_ids]
        per = ", ".join(f"{n} ({r})" for n, r in zip(counts, reasons, strict=True))
        speed = "n/a" if rate is None else f"{rate:.1f}"
        first = stream.first_token_seconds
        print(
            ("blocklab generate: interrupted; " if interrupted else "")
            + f"new tokens: {per}; {speed} tokens/s; first token after "
            f"{0.0 if first is None else first:.2f} s",
            file=sys.stderr,
        )
    return 130 if interrupted else 0


def _header(b: int, n: int) -> str:
    return f"==> prompt {b + 1}/{n} <=="
