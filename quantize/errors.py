"""One error hierarchy. Every error the user can cause is a QuantizeError: the CLI prints
its message on one line and exits non-zero, without a traceback unless QUANTIZE_DEBUG=1."""

from __future__ import annotations

import os


class QuantizeError(Exception):
    """Base class: a problem the user can fix. The message names the problem and the fix.

    Raised either with a whole message, or with structured fields the one-line message is
    composed from (tests assert the fields, not the prose):

    - `problem`: what is wrong, e.g. "has no config.json";
    - `hint`: how to fix it, e.g. "point --model at the folder that holds config.json";
    - `path`: the file, folder or location it is about (`line`: its line in that file).

    The message is `{path}[:{line}]{path_sep}{problem}; {hint}`, each part only when given
    (`path_sep` is ": " unless the sentence reads on from the path, as in "x has no y").
    A whole message (several problems in one line) may still carry `path` and `line`."""

    exit_code = 2

    def __init__(self, message: str | None = None, *, problem: str | None = None,
                 hint: str | None = None, path: str | os.PathLike[str] | None = None,
                 line: int | None = None, path_sep: str = ": ") -> None:
        self.problem = problem
        self.hint = hint
        self.path = None if path is None else os.fspath(path)
        self.line = line
        if message is None:
            if problem is None:
                raise TypeError("a QuantizeError needs a message or a problem")
            message = compose(problem, hint, self.path, line, path_sep)
        super().__init__(message)


def compose(problem: str, hint: str | None = None, path: str | None = None,
            line: int | None = None, path_sep: str = ": ") -> str:
    """The one-line message of a problem, its fix and where it is (see QuantizeError)."""
    head = problem
    if path is not None:
        where = f"{path}:{line}" if line else path
        head = f"{where}{path_sep}{problem}"
    return f"{head}; {hint}" if hint else head


class RecipeError(QuantizeError):
    """A recipe, calibration spec or eval suite is invalid."""


class ModelError(QuantizeError):
    """The model cannot be found, read, or is not supported."""


class PreflightError(QuantizeError):
    """A check before calibration found a recipe/model mismatch (e.g. group size)."""


class CalibrationError(QuantizeError):
    """The calibration data cannot be read or is too small for the spec."""


class QuantizationError(QuantizeError):
    """The quantization engine failed."""


class ExportError(QuantizeError):
    """The export is missing, incomplete or does not match its manifest."""


class EvalError(QuantizeError):
    """Evaluation could not run."""


class GateFailed(QuantizeError):
    """At least one blocking metric fell below its threshold."""

    exit_code = 3


class VerifyError(QuantizeError):
    """The checkpoint did not load or did not agree with the reference."""


class PublishError(QuantizeError):
    """Publishing was refused or failed."""


class LockedError(QuantizeError):
    """Another live process holds the run folder."""


class BackendUnavailable(QuantizeError):
    """An optional engine is not installed."""


class NotImplementedFeature(QuantizeError):
    """A feature that is planned but not built yet; never pretend it works."""


def first_line(exc: BaseException) -> str:
    """The first line of an upstream exception's message (or its type): quoted inside our
    one-line errors, which must not span lines."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class DiskError(QuantizeError):
    """The environment refused a write: no space left, over quota, a read-only file system or
    no permission. The message names the path and the fix; finished stages are kept, so
    re-running the same command after the fix resumes."""


class FitError(QuantizeError):
    """`quantize fit` cannot do what was asked (bad budget, nothing fits)."""


class PlanError(QuantizeError):
    """The memory plan cannot be made (unknown GPU, unreadable model config, bad option)."""


class ResourceError(QuantizeError):
    """Not enough memory for the requested stage."""


class PlacementError(QuantizeError):
    """Neither host RAM nor disk can hold the weights."""
