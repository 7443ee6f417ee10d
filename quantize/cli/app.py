"""The click group and the one error rule every command runs under: one line and a non-zero
exit for a failure; QUANTIZE_DEBUG=1 shows the traceback."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from quantize.errors import QuantizeError

F = TypeVar("F", bound=Callable[..., Any])


def _debug() -> bool:
    return os.environ.get("QUANTIZE_DEBUG", "") not in ("", "0")


def handle_errors(fn: F) -> F:
    """One line and a non-zero exit for every failure; the traceback only when debugging."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except QuantizeError as exc:
            if _debug():
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            if _debug():
                raise
            click.echo("interrupted: finished stages are kept; re-run the same command to "
                       "resume", err=True)
            sys.exit(130)
        except Exception as exc:
            if _debug():
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            click.echo(f"error: internal error {type(exc).__name__}: {first} (set "
                       "QUANTIZE_DEBUG=1 for the traceback and report it)", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantize")
def main() -> None:
    """quantize: recipe → calibrate → quantize → export → eval → gate, offline and resumable.

    Run `quantize run gptq-int4` to quantize the embedded default model.
    """
    if not sys.stderr.isatty():
        # A log file or CI console gets the engines' progress bars every 30 s instead of
        # several times a second (tqdm reads TQDM_* when it is first imported, which is later)
        os.environ.setdefault("TQDM_MININTERVAL", "30")


def echo_path(path: Path) -> None:
    click.echo(str(path))
