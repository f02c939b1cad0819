"""`stalwart` command line: one entry point, one module per subcommand (stalwart.commands)."""

from __future__ import annotations

import argparse
import sys

from stalwart import __version__
from stalwart.commands import chaos, check, ckpt, data, demo, master, plan, run, sim, status, trace, train
from stalwart.commands.common import fail
from stalwart.errors import WorkersFailed

COMMANDS = (train, data, demo, master, run, chaos, plan, sim, ckpt, check, trace, status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart",
        description="Reliable, elastic LLM pretraining on PyTorch's native distributed stack. "
        "Run `stalwart COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"stalwart {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Pass-through commands (run) parse their own arguments, torchrun style, --help included.
        if argv and argv[0] == "run":
            return run.run(argparse.Namespace(argv=argv[1:]))
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        overrides = {}
        if extra:
            if not getattr(args, "accepts_overrides", False):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            from stalwart.config import parse_overrides

            overrides = parse_overrides(extra)
        return args.handler(args, overrides, argv[1:])
    except ValueError as err:
        return fail(str(err), 2)
    except WorkersFailed as err:
        return fail(str(err), 1)


if __name__ == "__main__":
    sys.exit(main())
