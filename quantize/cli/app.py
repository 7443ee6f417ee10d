"""The click group and the one error rule every command runs under: one line and a non-zero
exit for a failure; QUANTIZE_DEBUG=1 shows the traceback."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from quantize.errors import QuantizeError

F = TypeVar("F", bound=Callable[..., Any])
# SIGTERM (a scheduler, `kill`, a container stop) and SIGHUP (the terminal closed) stop a run
# the way Ctrl-C does: the stage being built is removed, finished stages and the manifest are
# kept, the lock is released, and the same command resumes.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is, like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_stop(signum: int, _frame: Any) -> None:
    for sig in STOP_SIGNALS:  # a second TERM/HUP must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """Install the handlers for one command (main thread only), then put the old ones back."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _on_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
        click.echo(line, err=True)


def _debug() -> bool:
    return os.environ.get("QUANTIZE_DEBUG", "") not in ("", "0")


def handle_errors(fn: F) -> F:
    """One line and a non-zero exit for every failure; the traceback only when debugging."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _stop_signals():
                return fn(*args, **kwargs)
        except QuantizeError as exc:
            if _debug():
                raise
            _say(f"error: {exc}")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            if _debug():
                raise
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            by = f" ({signal.Signals(signum).name})" if isinstance(exc, Stopped) else ""
            _say(f"interrupted{by}: finished stages are kept; re-run the same command to "
                 "resume")
            sys.exit(128 + signum)
        except BrokenPipeError:  # `quantize recipes | head`: the reader left; say nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except Exception as exc:
            if _debug():
                raise
            from quantize.run.files import disk_error

            mapped = disk_error(exc)  # no space, quota, read-only, permission: exit 2
            if mapped is not None:
                _say(f"error: {mapped}")
                sys.exit(mapped.exit_code)
            first = (str(exc).strip().splitlines() or [""])[0]
            _say(f"error: internal error {type(exc).__name__}: {first} (set "
                 "QUANTIZE_DEBUG=1 for the traceback and report it)")
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantize")
def main() -> None:
    """quantize: recipe → calibrate → quantize → export → eval → gate, offline and resumable."""
    if not sys.stderr.isatty():
        # A log file or CI console gets the engines' progress bars every 30 s instead of
        # several times a second (tqdm reads TQDM_* when it is first imported, which is later)
        os.environ.setdefault("TQDM_MININTERVAL", "30")


def _main_help() -> str:
    """The group's help, its default recipe named from the one place that holds it."""
    from quantize.recipe.recipe import DEFAULT_RECIPE

    return (f"{main.help}\n\nRun `quantize run` to quantize the embedded default model with "
            f"the default recipe `{DEFAULT_RECIPE}` (`quantize recipes` lists the others).")


main.help = _main_help()


def openmp_waits_passively() -> bool:
    """Load torch with its OpenMP threads waiting passively (OMP_WAIT_POLICY=PASSIVE): a
    thread that finishes its share of an operation sleeps instead of spinning for the next.
    On a machine of few cores, a spinning thread takes the core another process (or a
    descheduled thread of our own operation) needs, and every later operation waits for it:
    on the 2-core machine, with other work running, GPTQ's solve took 7.7-11.4 s against
    0.5-0.6 s passive, a perplexity forward 13-14 s against 6.2-6.3 s (bench/RESULTS.md,
    "make quantize on 2 cores"). libgomp reads the variable once, when torch loads it, so this
    runs before torch is imported, and the variable is then removed again: the processes a
    run starts (the vLLM worker, torchrun) keep the environment the user gave. A user's own
    OMP_WAIT_POLICY is kept. Returns whether the policy was set here."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch  # noqa: F401  (loads libgomp, which reads the policy)
    finally:
        del os.environ["OMP_WAIT_POLICY"]
    return True

