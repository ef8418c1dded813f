"""`python -m lifecycle ...`: the machines' diagrams, and tools for checkpoints on disk."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence, TextIO

from lifecycle.boundary import MAX_STEP, os_error, role_problem
from lifecycle.errors import LifecycleError, printable
from lifecycle.machine import MACHINES
from lifecycle.types import plain_digits


class Printable:
    """A text stream whose every write is one piece of a line: its characters a terminal acts on are
    escaped (`printable`), except the line breaks and carriage returns it starts or ends with, which
    are the report's own. Everything the commands print about a root goes through it. None (a
    closed stderr, which Python sets to None) takes the writes and drops them."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        body = text.lstrip("\r\n")
        head = text[:len(text) - len(body)]
        core = body.rstrip("\n")
        return len(text) if self.stream is None else self.stream.write(head + printable(core) + body[len(core):])

    def flush(self) -> None:
        if self.stream is not None:
            self.stream.flush()

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()


def _diagram(args: argparse.Namespace) -> int:
    sys.stdout.write(MACHINES[args.machine].mermaid())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from lifecycle.report import inspect_root

    return inspect_root(args.root, args.roles, Printable(sys.stdout))


def _verify(args: argparse.Namespace) -> int:
    from lifecycle.report import verify_root

    return verify_root(args.root, args.step, args.roles, Printable(sys.stdout), Printable(sys.stderr))


def _convert(args: argparse.Namespace) -> int:
    from lifecycle.convert import ConvertJob, convert

    job = ConvertJob(src=args.src, dst=args.dst, to=args.to, tp=args.tp, pp=args.pp, hf_config=args.hf_config)
    print(printable(f"converted: {convert(job)}"))
    return 0


def _root(text: str) -> Path:
    """A root argument: an empty one names no folder (Path("") would be the current one)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no checkpoint root")
    return Path(text)


def _step(text: str) -> int:
    """A step argument in plain ASCII digits (int() would also take '2_0' and '٢'), at most `MAX_STEP`."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{printable(text[:40])!r} is not a step number (digits 0-9)")
    if (number := plain_digits(text.lstrip("0") or "0")) is None:  # more digits than a step folder holds
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(f"{shown} is out of range: a step is at most {MAX_STEP}")
    return number


def _role(text: str) -> str:
    """A --roles name, refused while parsing as the library refuses it: before any step is read."""
    if problem := role_problem(text):
        raise argparse.ArgumentTypeError(printable(problem))
    return text


class _Roles(argparse.Action):
    """--roles, each named once, in the order given; a second --roles adds to the first (argparse
    would replace it, leaving the first's roles unchecked)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, list(dict.fromkeys([*given, *(values or ())])))


class _Parser(argparse.ArgumentParser):
    """A parser whose errors reach the terminal escaped: argparse quotes the command line's own
    arguments in them (`unrecognized arguments: ...`) as they are."""

    def error(self, message: str) -> NoReturn:
        super().error(printable(message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    diagram = sub.add_parser("diagram", help="print a state machine as a Mermaid diagram, from its table")
    diagram.add_argument("--machine", choices=sorted(MACHINES), default="trainer",
                         help="the trainer's lifecycle (default), a rollout's weights, or the Ray driver's run")
    diagram.set_defaults(run=_diagram)
    roles_help = "roles a complete step must hold (default: every role found on disk)"
    inspect = sub.add_parser("inspect", help="table of steps and roles: contents, format, size, complete or why not")
    inspect.add_argument("root", type=_root)
    inspect.add_argument("--roles", nargs="+", type=_role, action=_Roles, help=roles_help)
    inspect.set_defaults(run=_inspect)
    verify = sub.add_parser("verify", help="re-check sizes and checksums; exit 0 only when all is well")
    verify.add_argument("root", type=_root)
    verify.add_argument("--step", type=_step, help="only this step (default: every step)")
    verify.add_argument("--roles", nargs="+", type=_role, action=_Roles, help=roles_help)
    verify.set_defaults(run=_verify)
    convert = sub.add_parser("convert", help="HF safetensors <-> Megatron dist checkpoint, on tp*pp local processes")
    convert.add_argument("src", type=Path, help="an HF folder or a dist checkpoint folder")
    convert.add_argument("dst", type=Path, help="the folder to create (absent or empty)")
    convert.add_argument("--to", required=True, choices=["hf", "dist_ckpt"])
    convert.add_argument("--tp", type=int, default=1, help="tensor parallel size to convert at (default 1)")
    convert.add_argument("--pp", type=int, default=1, help="pipeline parallel size to convert at (default 1)")
    convert.add_argument("--hf-config", type=Path, help="HF folder naming the architecture of a dist checkpoint "
                         "that has no config.json of its own")
    convert.set_defaults(run=_convert)
    return parser


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (SIGINT), as shells give one: 128 + 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; its failures, a closed stdout and Ctrl-C end in one `error:` line, never a traceback."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((word for word in words if word in ("diagram", "inspect", "verify", "convert")), "lifecycle")
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _error(f"{command}: interrupted")
        return INTERRUPTED


def entry() -> NoReturn:
    """The console script's and `python -m lifecycle`'s entry: `main`, exiting with its status.
    Stopped by Ctrl-C, the process ends by SIGINT once its error line is out, as a shell expects
    of an interrupted command (`for f in ...; do python -m lifecycle verify "$f"; done` stops too);
    `main` itself returns 130, so a caller in the same process is not killed."""
    status = main()
    if status == INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):  # dying by a signal flushes nothing
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(status)  # where SIGINT cannot end the process (Windows), its status


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    if sys.stdout is None:  # started with stdout closed (`>&-`): every command reports there
        _error("stdout is closed")
        return 2
    for stream in (sys.stdout, sys.stderr):  # file names that are not UTF-8 print escaped, never crash
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    quoted = [str(value) for value in vars(args).values() if isinstance(value, Path)]
    try:
        return run(args)
    except LifecycleError as exc:
        _error(str(exc), quoted)
        return 2
    except OSError as exc:  # a path the commands did not wrap themselves: still a line, not a traceback
        _error(str(os_error(exc, args.command)), quoted)
        return 2


def _error(message: str, quoted: Sequence[str] = ()) -> None:
    """`error: message` on stderr, each of its own lines printable. The library starts each line
    after the first with an indent; any other line break, and every one inside a path given on
    the command line (`quoted`), is escaped rather than let forge a line of its own. Nothing is
    written with stderr closed (print would write to stdout instead)."""
    if sys.stderr is None:
        return
    for text in quoted:
        message = message.replace(text, printable(text))
    print("error: " + "\n  ".join(map(printable, message.split("\n  "))), file=sys.stderr)
