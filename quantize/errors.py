"""One error hierarchy. Every error the user can cause is a QuantizeError: the CLI prints
its message on one line and exits non-zero, without a traceback unless QUANTIZE_DEBUG=1."""

from __future__ import annotations


class QuantizeError(Exception):
    """Base class: a problem the user can fix. The message names the problem and the fix."""

    exit_code = 2


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
