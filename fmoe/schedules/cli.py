"""``fmoe schedule show NAME ...`` and ``fmoe schedule check FILE.csv``: timelines and figures.

``main(argv)`` takes the words after ``schedule``; on bad input - an argument, a file it cannot read,
a table that does not parse or validate - it prints one line ``fmoe: error: ...`` to stderr and
returns 2 (as every ``fmoe`` command), else 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generators import GENERATORS, generate
from .render import ascii_timeline, figures, save_png
from .simulator import Costs, simulate
from .table import Schedule, ScheduleError, read_csv, write_csv
from .verify import lower, validate


class _Exit(Exception):
    def __init__(self, code: int, message: str = ""):
        super().__init__(message)
        self.code, self.message = code, message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise _Exit(2, message)

    def exit(self, status: int = 0, message: str | None = None):  # --help
        raise _Exit(status, message or "")


def parse_costs(text: str) -> Costs:
    """``f=1,b=1,w=0.5,fb=2,transfer=0.1``; a value may be per stage, ``f=1/1/2/2``."""
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("f", "b", "w", "bw", "fb", "transfer"):
            raise ScheduleError(
                f"--costs: {part!r} is not NAME=VALUE with NAME one of f, b, w, bw, fb, transfer"
            )
        try:
            nums = tuple(float(v) for v in value.split("/"))
        except ValueError:
            raise ScheduleError(
                f"--costs: {key}={value!r} is not a number (or numbers joined by '/')"
            ) from None
        fields[key] = nums[0] if len(nums) == 1 else nums
    return Costs(**fields)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fmoe schedule", description="Pipeline schedules as tables: show, check.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    show = sub.add_parser("show", help="generate a schedule, print its timeline and figures")
    show.add_argument("name", help=f"one of {', '.join(GENERATORS)}")
    show.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    show.add_argument("--microbatches", type=int, required=True)
    show.add_argument("--chunks", type=int, help="chunks per rank (interleaved-1f1b; default 2)")
    show.add_argument("--csv", help="write the table to this CSV file")
    show.add_argument("--lowered", action="store_true", help="write the table with its SEND/RECV rows")
    check = sub.add_parser("check", help="validate a CSV table, print its timeline and figures")
    check.add_argument("file")
    for q in (show, check):
        q.add_argument("--png", help="write a PNG timeline coloured by action")
        q.add_argument(
            "--costs", default="", help="action times, e.g. f=1,b=1,w=1,fb=1.5,transfer=0 (default 1 each)"
        )
        q.add_argument("--width", type=int, default=160, help="characters of the text timeline (default 160)")
    return p


def _report(s: Schedule, costs: Costs, png: str | None, width: int) -> None:
    result = simulate(s, costs)
    print(ascii_timeline(s, result, width))
    print(figures(s, result, costs))
    if png:
        save_png(s, result, png)
        print(f"wrote {png}")


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        costs = parse_costs(args.costs)
        if args.width < 20:
            raise ScheduleError(f"--width must be >= 20, got {args.width}")
        for flag, path in (("--csv", args.csv if args.cmd == "show" else None), ("--png", args.png)):
            if path and not Path(path).resolve().parent.is_dir():  # before any output, not after the table
                raise ScheduleError(f"{flag} {path}: its folder {Path(path).resolve().parent} does not exist")
        if args.cmd == "show":
            options = {} if args.chunks is None else {"chunks": args.chunks}
            s = generate(args.name, args.pp, args.microbatches, **options)
            if args.csv:
                write_csv(lower(s) if args.lowered else s, args.csv)
                print(f"wrote {args.csv}")
            _report(s, costs, args.png, args.width)
            return 0
        s = read_csv(args.file)
        try:
            validate(s)
        except ScheduleError as e:
            raise ScheduleError(f"invalid table: {e}") from None
        print(f"{args.file}: valid")
        _report(s, costs, args.png, args.width)
        return 0
    except _Exit as e:
        if e.code and e.message:
            print(f"fmoe: error: {e.message.strip()}", file=sys.stderr)
        elif e.message:
            print(e.message, end="")
        return e.code
    except BrokenPipeError:
        raise  # the reader went away: not bad input (fmoe.cli ends quietly)
    except (ScheduleError, OSError) as e:
        print(f"fmoe: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
