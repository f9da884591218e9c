"""The command line: `blocklab report` and one command per study.

Parse, call one study in `blocklab.experiments`, render its result; nothing
else lives here (`app` is the entry point, `commands/` the subcommands,
`report` the chapter report).
"""

from .app import main

__all__ = ["main"]
