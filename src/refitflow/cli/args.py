"""What every ``refitflow`` sub-command's arguments share: one-line errors, defaults in the help, checked numbers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["OneLineParser", "positive"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), and whose help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` above zero."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above zero, got {text}")
        return value

    return parse
