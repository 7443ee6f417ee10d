"""Thin click commands over the library (quantize.cli.app holds the group and the error
rule; each command module registers its commands on import)."""

from __future__ import annotations

from quantize.cli import (  # noqa: F401 (registers)
    commands,
    convert_cmd,
    fit_cmd,
    plan_cmd,
    publish_cmd,
    verify_cmd,
)
from quantize.cli.app import main

__all__ = ["main"]
