"""`metaloom` command line. Each subcommand lives in `metaloom/commands/` and registers its
own parser; this edge lists them. Every `MetaloomError` becomes one line on stderr and exit
status 2, except a remote server that cannot be reached (`ServerUnreachable`): status 3."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from metaloom.commands import bench, evaluate, generate, report, run, score, serve, strategies, train_speculator, tree
from metaloom.errors import MetaloomError, ServerUnreachable

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3  # --backend openai: no connection to the server (down, or gone mid-run)
EXIT_STATUSES = ("exit status: 0 done; 1 a streamed generation ended in an error; 2 bad input or a request "
                 "refused (one 'error:' line); 3 a remote server (--backend openai) could not be reached: "
                 "refused, reset or closed the connection, the line names the URL and the cause; "
                 "130 interrupted")

# each entry: register(subparsers) adds one subcommand whose parser sets `run`
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [generate.register, bench.register]
COMMANDS += [run.register, strategies.register]  # meta-generation
COMMANDS += [score.register]  # log-probabilities of continuations
COMMANDS += [serve.register]  # the OpenAI-compatible server
COMMANDS += [train_speculator.register]  # speculator heads (metaloom.speculative.heads)
COMMANDS += [tree.register]  # render a search tree from a --json result
COMMANDS += [evaluate.register, report.register]  # accuracy-vs-compute sweeps and their report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metaloom", description="Make a language model better and faster at inference time.",
                                     epilog=EXIT_STATUSES)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ServerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MetaloomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
