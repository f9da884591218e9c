r"""A checkpoint folder's tokenizer without `transformers`: `load_tokenizer`.

A checkpoint folder ships its tokenizer as files: `tokenizer.json` (the Rust
`tokenizers` serialization: normalizer, pre-tokenizer, model, post-processor,
decoder and added tokens), `tokenizer_config.json` (the special tokens by
name, and the chat template in folders written before `transformers` 5),
sometimes `special_tokens_map.json`, and `chat_template.jinja` (with named
templates in `additional_chat_templates/`) in folders written by
`transformers` 5. `load_tokenizer(path)` reads them with `tokenizers` and
`jinja2` alone; neither `transformers` nor torch is imported.

The rules are those of `transformers.AutoTokenizer` 5.24 on a folder with a
`tokenizer.json`:

- The named special tokens (`bos_token`, `eos_token`, `unk_token`,
  `sep_token`, `pad_token`, `cls_token`, `mask_token`), any other
  `*_token` string of `tokenizer_config.json` (Gemma 3's `boi_token`, ...)
  and `extra_special_tokens` (or `additional_special_tokens`) are read from
  `tokenizer_config.json`; `special_tokens_map.json` overrides them when
  `tokenizer_config.json` has no `added_tokens_decoder` (and is ignored when
  it has one). A string or a `{"content": ...}` object is accepted. A special
  token that is not an added token of `tokenizer.json` is added as one (with
  the next free id, as `transformers` adds it).
- Whether BOS (or EOS) is added is the post-processor's decision: `encode`
  runs the post-processor of `tokenizer.json` when `add_special_tokens`.
  `add_bos_token` / `add_eos_token` in `tokenizer_config.json` are not read:
  `transformers` 5 drops them when `tokenizer.json` is present (4.x rebuilt
  the post-processor from them for some classes; a folder written by 4.x
  stores the post-processor they built).
- `split_special_tokens: true` encodes special tokens written in the text as
  text. `clean_up_tokenization_spaces: true` removes the space before
  punctuation in `decode`, except for a BPE model (as `transformers` 5).
- The chat template is `chat_template.jinja` (and the files of
  `additional_chat_templates/`, by name), else `chat_template` of
  `tokenizer_config.json` (one string, or a list of `{"name", "template"}`).

One difference in the pipeline: `transformers` 5 rebuilds the normalizer,
pre-tokenizer and decoder of some named classes (`LlamaTokenizer`,
`GemmaTokenizer`, `GPT2Tokenizer`, ...) from its own code and keeps only the
vocabulary, merges and post-processor of `tokenizer.json`; blocklab runs the
pipeline `tokenizer.json` states. For a folder written by `transformers` 5
the two are the same pipeline. A folder written earlier whose
`tokenizer.json` states another one (Llama 2's `Prepend` + `Replace`
normalizer where `transformers` 5 uses a `Metaspace` pre-tokenizer) can get
other ids for text that follows a special token written in the text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jax
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np
import tokenizers
from jaxtyping import Int

from .._validate import ConfigError, check_bool

__all__ = ["Tokenizer", "load_tokenizer"]

#: The named special tokens, in `transformers`' order (new ids are given in it).
_NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

#: Names a message's reasoning comes under; templates read the first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    r"""A checkpoint folder's tokenizer (made by `load_tokenizer`).

    `encode` maps a text $s$ to ids: the added tokens written in $s$ are cut
    out first (special tokens among them, unless `split_special_tokens`), each
    piece between them is normalized, pre-tokenized and split by the model
    (BPE merges, or byte fallback for an unknown character), and the
    post-processor wraps the ids (`<s> $A`: BOS first) when
    `add_special_tokens`. `decode` maps ids back through the decoder (byte
    level, or `▁` to space with byte fallback).

    It is the `tokenizer` of `blocklab.generate_text`: `encode(str)` and
    `decode(ids)`.

    Attributes:
        path: the folder it was read from.
        vocab_size: the number of ids, added tokens included (`len` of the
            `transformers` tokenizer; its `vocab_size` leaves added tokens out).
        bos_id: the id of `bos_token`, or `None` where the folder names none.
        eos_id: the id of `eos_token` (or `None`): one id, the tokenizer's, as
            `transformers`' `eos_token_id`; see `stop_ids` for a chat model's.
        pad_id: the id of `pad_token`, or `None`.
        stop_ids: the ids that end a generated text: `eos_id`, then those of
            `eos_token_id` in `generation_config.json` (an id or a list: chat
            models list their end-of-turn token there), each once.
        adds_bos: whether `encode(text)` starts with BOS (the post-processor
            adds it).
        special_tokens: the named special tokens (`bos_token`, ..., and the
            folder's other `*_token` names) as the chat template sees them.
        chat_templates: the chat templates by name (`"default"` for the
            folder's main one); empty if the folder has none.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        path: Path,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        clean_up_spaces: bool,
        generation_eos: Sequence[int],
    ) -> None:
        self._backend = backend
        self.path = path
        self.special_tokens = types.MappingProxyType(dict(special_tokens))
        self.chat_templates = types.MappingProxyType(dict(chat_templates))
        self._clean_up_spaces = clean_up_spaces
        self._compiled: dict[str, jinja2.Template] = {}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._id_of("bos_token")
        self.eos_id = self._id_of("eos_token")
        self.pad_id = self._id_of("pad_token")
        first = [] if self.eos_id is None else [self.eos_id]
        self.stop_ids = tuple(dict.fromkeys([*first, *generation_eos]))
        # "a", not "": a post-processor that appends EOS = BOS (GPT-2's one
        # token) must not count as adding BOS
        first = backend.encode("a", add_special_tokens=True).ids[:1]
        self.adds_bos = self.bos_id is not None and first == [self.bos_id]

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})"
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`.

        Args:
            text: any string; special tokens written in it (`"<s>"`) are
                their ids unless the folder sets `split_special_tokens`.
            add_special_tokens: run the post-processor (BOS first where the
                folder adds it, see `adds_bos`).

        Returns:
            The ids, as `transformers.AutoTokenizer(path).encode` gives them.
        """
        if not isinstance(text, str):
            raise ConfigError(
                f"Tokenizer.encode: text must be a str, got {type(text).__name__}."
            )
        add = check_bool("Tokenizer.encode", "add_special_tokens", add_special_tokens)
        return self._backend.encode(text, add_special_tokens=add).ids

    def decode(
        self,
        ids: Sequence[int | np.integer] | Int[np.ndarray, " T"] | Int[jax.Array, " T"],
        *,
        skip_special_tokens: bool = False,
    ) -> str:
        """The text of `ids`.

        Args:
            ids: a sequence (or 1-D integer array) of ids >= 0. An id the
                tokenizer does not have (a model's vocabulary is often padded
                beyond the tokenizer's) gives no text, as in `transformers`.
            skip_special_tokens: leave the special tokens out of the text
                (`False`, as in `transformers`, writes them; the default of
                `tokenizers.Tokenizer.decode` is the other one).

        Returns:
            The text, as `transformers.AutoTokenizer(path).decode` gives it.
        """
        skip = check_bool(
            "Tokenizer.decode", "skip_special_tokens", skip_special_tokens
        )
        values = np.asarray(ids)
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise ConfigError(
                "Tokenizer.decode: ids must be a flat sequence of integers, got "
                f"shape {values.shape} of dtype {values.dtype}."
            )
        bad = np.flatnonzero(values < 0)
        if bad.size:
            raise ConfigError(
                f"Tokenizer.decode: ids[{bad[0]}] = {values[bad[0]]} is negative; "
                "ids are in [0, vocab_size)."
            )
        text = self._backend.decode(values.tolist(), skip_special_tokens=skip)
        if self._clean_up_spaces:
            text = _clean_up_spaces(text)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """One conversation rendered by the folder's chat template.

        Rendered as `transformers.AutoTokenizer(path).apply_chat_template`
        renders it: jinja2 in a sandbox (immutable), with `trim_blocks` and
        `lstrip_blocks`, the `loopcontrols` extension and the
        `{% generation %}` tag (its body rendered unchanged); the globals
        `raise_exception(msg)`, `strftime_now(fmt)` (local time), `dict`
        and `namespace` (underscore names refused); `tojson` as `json.dumps`
        (`ensure_ascii=False`; `indent`, `separators`, `sort_keys` as
        keywords). The template sees `messages` (plain data; keys whose
        value is `None` dropped; a reasoning given as `reasoning_content`,
        `thinking` or `reasoning` also under the first two),
        `add_generation_prompt`, `tools`, `documents`, the special tokens
        (`bos_token`, ...: see `special_tokens`) and `extra`, which overrides
        them.

        One difference: a variable the template reads that nothing gives
        (`{{ system_name }}` with no `system_name=`) is refused with a
        `ConfigError` naming it, where `transformers` renders it as empty
        text and false. Test it with `is defined` or `| default(...)` in a
        template for an optional variable (both work). A key missing from a
        message (`message.tool_calls`) is undefined as in `transformers`.

        Args:
            messages: the conversation, a non-empty list of dicts (`role`,
                `content`, ...).
            add_generation_prompt: the template's variable of that name (the
                template decides what it appends, e.g. the assistant header).
            tokenize: return the ids of the text (encoded without the
                post-processor: the template writes BOS itself) instead of
                the text. A list of ids, where `transformers` gives a dict.
            tools: JSON schemas of tools (dicts), passed as `tools`; with
                them, a folder's template named `tool_use` is the default.
            documents: dicts passed as `documents`.
            chat_template: the name of one of `chat_templates`, or the text
                of a template; default: `tool_use` with tools if the folder
                has it, else `default`.
            **extra: further template variables (`enable_thinking=False`,
                `date_string=...`).

        Returns:
            The text, or its ids with `tokenize=True`.

        Raises:
            ConfigError: no chat template, an empty conversation, a message
                that is not a dict, a variable no one gives, a template that
                does not parse or calls `raise_exception`.
        """
        owner = "Tokenizer.apply_chat_template"
        add_prompt = check_bool(owner, "add_generation_prompt", add_generation_prompt)
        to_ids = check_bool(owner, "tokenize", tokenize)
        name, source = self._chat_template(chat_template, tools is not None)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ConfigError(
                f"{owner}: messages must be a list of dicts, got "
                f"{type(messages).__name__}."
            )
        if not messages:
            raise ConfigError(f"{owner}: messages is empty; give at least one message.")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ConfigError(
                    f"{owner}: messages[{i}] must be a dict (role, content, ...), "
                    f"got {type(message).__name__}."
                )
            kept = {k: _plain(v) for k, v in message.items() if v is not None}
            chat.append(_alias_reasoning(kept))
        variables = {
            **self.special_tokens,
            **{k: _plain(v) for k, v in extra.items()},
        }
        template = self._compile(name, source)
        try:
            text = template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_prompt,
                **variables,
            )
        except _UnknownVariable as err:
            given = ["messages", "add_generation_prompt", "tools", "documents"]
            raise ConfigError(
                f"{owner}: the chat template {name!r} of {self.path} reads the "
                f"variable {err.name!r}, which nothing gives: pass it as a "
                f"keyword ({err.name}=...). Given: "
                f"{', '.join([*given, *variables])}."
            ) from None
        except jinja2.TemplateError as err:
            raise ConfigError(
                f"{owner}: the chat template {name!r} of {self.path} refused the "
                f"conversation: {err}"
            ) from err
        return self.encode(text, add_special_tokens=False) if to_ids else text

    def _chat_template(self, chosen: str | None, with_tools: bool) -> tuple[str, str]:
        """The (name, text) of the template to render, chosen as `transformers` does."""
        owner = "Tokenizer.apply_chat_template"
        if chosen is not None:
            if not isinstance(chosen, str):
                raise ConfigError(
                    f"{owner}: chat_template must be a template name or text, got "
                    f"{type(chosen).__name__}."
                )
            if chosen in self.chat_templates:
                return chosen, self.chat_templates[chosen]
            return "chat_template=", chosen
        if not self.chat_templates:
            raise ConfigError(
                f"{owner}: {self.path} has no chat template (no chat_template.jinja "
                "and no chat_template in tokenizer_config.json); pass one as "
                "chat_template=..."
            )
        for name in ("tool_use", "default") if with_tools else ("default",):
            if name in self.chat_templates:
                return name, self.chat_templates[name]
        raise ConfigError(
            f"{owner}: {self.path} has several chat templates and none is named "
            f"'default'; choose one with chat_template=, one of "
            f"{sorted(self.chat_templates)}."
        )

    def _compile(self, name: str, source: str) -> jinja2.Template:
        if source not in self._compiled:
            try:
                self._compiled[source] = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as err:
                raise ConfigError(
                    f"Tokenizer.apply_chat_template: the chat template {name!r} of "
                    f"{self.path} does not parse: {err.message} (line {err.lineno})."
                ) from err
        return self._compiled[source]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint folder, read with `tokenizers` alone.

    Args:
        path: a folder holding `tokenizer.json` (and usually
            `tokenizer_config.json`), as `transformers` writes it with
            `save_pretrained`.

    Returns:
        A `Tokenizer` whose `encode`, `decode` and `apply_chat_template` give
        what `transformers.AutoTokenizer.from_pretrained(path)` gives (see the
        module's documentation for the rules and the one difference).

    Raises:
        ConfigError: `path` is not a folder, has no `tokenizer.json` (a
            sentencepiece `tokenizer.model` alone is not read), or a file
            that does not parse; each message names the file.
    """
    owner = "load_tokenizer"
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"{owner}: path must be a folder path (str or Path), got "
            f"{type(path).__name__}."
        )
    folder = Path(path)
    if not folder.is_dir():
        hint = " (give its folder)" if folder.name == "tokenizer.json" else ""
        raise ConfigError(f"{owner}: {folder} is not a folder{hint}.")
    file = folder / "tokenizer.json"
    if not file.is_file():
        found = sorted(p.name for p in folder.iterdir())
        hint = (
            " It has a sentencepiece tokenizer.model, which blocklab does not "
            "read: write tokenizer.json once with transformers "
            "(AutoTokenizer.from_pretrained(path).save_pretrained(path))."
            if "tokenizer.model" in found
            else ""
        )
        raise ConfigError(
            f"{owner}: {folder} has no tokenizer.json, so no tokenizer to read "
            f"(it holds: {', '.join(found) or 'nothing'}).{hint}"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust parser's errors are plain Exceptions
        raise ConfigError(
            f"{owner}: {file} is not a tokenizers file that parses: {err}"
        ) from err

    config = _read_json(folder / "tokenizer_config.json") or {}
    if "added_tokens_decoder" not in config:
        config = _merge_special_tokens_map(
            config, _read_json(folder / "special_tokens_map.json") or {}
        )
    special: dict[str, str] = {}
    to_add: list[tokenizers.AddedToken] = []
    names = [*_NAMED_TOKENS, *(k for k in config if k not in _NAMED_TOKENS)]
    for key in names:
        value = config.get(key)
        if key.endswith("_token") and (
            isinstance(value, str) or (key in _NAMED_TOKENS and value is not None)
        ):
            token = _added_token(value, f"{folder / 'tokenizer_config.json'}: {key}")
            special[key] = token.content
            to_add.append(token)
    extra = config.get("extra_special_tokens") or config.get(
        "additional_special_tokens"
    )
    if isinstance(extra, Mapping):  # named extra tokens: template variables too
        for key, value in extra.items():
            token = _added_token(value, f"extra_special_tokens: {key}")
            special.setdefault(str(key), token.content)
            to_add.append(token)
    elif isinstance(extra, list):
        where = f"{folder / 'tokenizer_config.json'}: extra_special_tokens"
        to_add += [_added_token(v, where) for v in extra]
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = {t.content: t for t in to_add if t.content not in present}
    if missing:
        backend.add_special_tokens(list(missing.values()))
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    clean_up = config.get("clean_up_tokenization_spaces", False) is True
    generation = _read_json(folder / "generation_config.json") or {}
    eos = generation.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not (isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
        raise ConfigError(
            f"{owner}: {folder / 'generation_config.json'}: eos_token_id must be "
            f"an id or a list of ids, got {generation.get('eos_token_id')!r}."
        )
    return Tokenizer(
        backend,
        path=folder,
        special_tokens=special,
        chat_templates=_chat_templates(folder, config),
        clean_up_spaces=clean_up and type(backend.model).__name__ != "BPE",
        generation_eos=eos,
    )


def _read_json(file: Path) -> dict[str, Any] | None:
    """The JSON object in `file`, `None` if there is no such file."""
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"load_tokenizer: {file} is not readable JSON: {err}"
        ) from err
    if not isinstance(value, dict):
        raise ConfigError(
            f"load_tokenizer: {file} must hold a JSON object, got "
            f"{type(value).__name__}."
        )
    return value


def _merge_special_tokens_map(
    config: dict[str, Any], tokens_map: dict[str, Any]
) -> dict[str, Any]:
    """`tokenizer_config.json` with `special_tokens_map.json` over it (lists joined)."""
    merged = dict(config)
    for key, value in tokens_map.items():
        if key in ("extra_special_tokens", "additional_special_tokens") and (
            isinstance(value, list)
        ):
            before = merged.get("extra_special_tokens") or merged.get(
                "additional_special_tokens"
            )
            before = before if isinstance(before, list) else []
            merged.pop("additional_special_tokens", None)
            merged["extra_special_tokens"] = before + [
                v for v in value if v not in before
            ]
        else:
            merged[key] = value
    return merged


def _added_token(value: Any, where: str) -> tokenizers.AddedToken:
    """A special token from a string or a `{"content": ...}` object."""
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=True, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        flags = {
            k: bool(value[k])
            for k in ("single_word", "lstrip", "rstrip", "normalized")
            if k in value
        }
        return tokenizers.AddedToken(
            value["content"], **{"normalized": False, **flags, "special": True}
        )
    raise ConfigError(
        f"load_tokenizer: {where} must be a token string or an object with a "
        f"'content' string, got {value!r}."
    )


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The chat templates by name: the `.jinja` files first, else the config's."""
    templates = {}
    main = folder / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    named = folder / "additional_chat_templates"
    if named.is_dir():
        for file in sorted(named.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(
                encoding="utf-8"
            )
    if templates:
        return templates
    stored = config.get("chat_template")
    if stored is None:
        return {}
    if isinstance(stored, str):
        return {"default": stored}
    if isinstance(stored, list) and all(
        isinstance(t, Mapping)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in stored
    ):
        return {t["name"]: t["template"] for t in stored}
    raise ConfigError(
        f"load_tokenizer: {folder / 'tokenizer_config.json'}: chat_template must "
        "be a template string or a list of {'name': ..., 'template': ...}, got "
        f"{type(stored).__name__}."
    )


def _clean_up_spaces(text: str) -> str:
    """`transformers`' `clean_up_tokenization`: no space before punctuation."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _plain(value: Any) -> Any:
    """`value` as plain data (what a sandboxed template may see).

    Strings, numbers, booleans and `None` as their base types; dicts, lists
    and tuples rebuilt; NumPy scalars as Python ones; dataclasses as dicts;
    anything else as a placeholder naming its type (`"<ndarray>"`), so no
    method of a user's object is reachable from a template.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums): their plain value
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning also under `thinking` and `reasoning_content`."""
    reasoning = next(
        (message[k] for k in _REASONING_KEYS if message.get(k) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _UnknownVariable(jinja2.UndefinedError):
    """A template read a top-level variable that nothing gives."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name!r} is undefined")
        self.name = name


class _Undefined(jinja2.Undefined):
    """Strict for a top-level name, lenient (jinja2's default) for a missing key.

    `{{ x }}`, `{% if x %}`, `{% for i in x %}` on a name that nothing gives
    raise `_UnknownVariable`; `x is defined` and `x | default(...)` work.
    A missing attribute or key (`message.tool_calls`) renders as empty text
    and is false, as in `transformers` (chat templates rely on it).
    """

    __slots__ = ()

    def _strict(self) -> None:
        if self._undefined_obj is jinja2.utils.missing and self._undefined_name:
            raise _UnknownVariable(self._undefined_name)

    def __str__(self) -> str:
        self._strict()
        return super().__str__()

    def __iter__(self) -> Any:
        self._strict()
        return super().__iter__()

    def __bool__(self) -> bool:
        self._strict()
        return super().__bool__()

    def __len__(self) -> int:
        self._strict()
        return super().__len__()

    def __eq__(self, other: object) -> bool:
        self._strict()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        self._strict()
        return super().__ne__(other)

    def __hash__(self) -> int:
        return super().__hash__()

    def __contains__(self, item: object) -> bool:
        self._strict()
        return False


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged.

    `transformers` uses the tag to mark the assistant's text for a training
    mask; a template that has it must still parse and render the same text.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore names (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # self is positional-only in effect, so `namespace(self=1)` still works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore name {name!r} on a "
                "namespace."
            )


class _DictBuilder:
    """The template's `dict`: `dict(...)` and `dict.fromkeys(...)`, nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates want JSON
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandboxed jinja2 environment of every chat template (built once)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        undefined=_Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _Namespace
    return env
