"""`blocklab COMMAND --help` describes every option and argument it lists."""

import argparse

import pytest

from blocklab.cli import app as cli


def _commands():
    parser = cli.build_parser()
    (action,) = parser._subparsers._group_actions
    seen, out = set(), []
    for name, sub in action.choices.items():  # aliases share their parser
        if id(sub) not in seen:
            seen.add(id(sub))
            out.append((name, sub))
    return out


COMMANDS = _commands()


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_has_a_description(name, parser):
    bare = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if a.help in (None, "", argparse.SUPPRESS)
    ]
    assert not bare, f"blocklab {name} --help lists {bare} without a description"
    # and the help text shows them (argparse prints nothing for help=None)
    text = parser.format_help()
    for a in parser._actions:
        if a.option_strings:
            assert a.option_strings[-1] in text


def test_census_help_describes_its_options():
    """The five census options the issue found bare."""
    (parser,) = [p for n, p in COMMANDS if n == "census"]
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for flag in ("--num-hiddens", "--num-heads", "--norm", "--placement", "--bias"):
        assert helps[flag] and len(helps[flag]) > 10, flag


#: The commands that run for minutes: each prints an estimate before it starts.
LONG = (
    "activations", "check", "lr-sensitivity", "mup", "proxies", "induction",
    "real-text", "signal",
)  # fmt: skip


@pytest.mark.parametrize("name", LONG)
def test_every_long_command_prints_an_estimate(name):
    parser = cli.build_parser()
    args = parser.parse_args([name])
    line = cli._estimate_line(args)
    assert line.startswith(f"blocklab {name}: ") and "about " in line
    assert "2 CPU cores" in line
    quiet = (
        parser.parse_args([name, "--no-progress"])
        if name not in ("check", "signal")
        else None
    )
    if quiet is not None:
        assert cli._estimate_line(quiet) is None  # --no-progress: no line
