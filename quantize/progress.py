"""Console output: one place for progress lines, so stages stay quiet functions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)


def info(msg: str) -> None:
    console.print(msg)


def warn(msg: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {msg}")


@contextlib.contextmanager
def step(msg: str) -> Iterator[None]:
    """Print what starts, then how long it took (or that it failed)."""
    console.print(f"[cyan]…[/cyan] {msg}")
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        console.print(f"[red]✗[/red] {msg} (after {time.perf_counter() - t0:.1f}s)")
        raise
    console.print(f"[green]✓[/green] {msg} ({time.perf_counter() - t0:.1f}s)")
