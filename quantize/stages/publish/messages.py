"""What publish prints: never rich markup by accident, never a token; its refusals."""

from __future__ import annotations

import os
import re

from quantize.errors import PublishError, QuantizeError, compose
from quantize.progress import warn as _warn

_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{8,}")


def warn(msg: str) -> None:
    """A warning line; the text is escaped so that brackets in it are not rich markup."""
    from rich.markup import escape

    _warn(escape(msg))


def refused(problem: str, hint: str | None = None,
            path: str | os.PathLike[str] | None = None) -> PublishError:
    """A release refused: `refused: {problem}; {hint}`. `path`, the file or folder it is
    about, is a field only: the problem names it where the sentence needs it."""
    return PublishError("refused: " + compose(problem, hint), problem=problem, hint=hint,
                        path=path)


def refused_by(exc: QuantizeError) -> PublishError:
    """An error found while reading the run, as a refusal: its message and fields kept."""
    return PublishError(f"refused: {exc}", problem=exc.problem, hint=exc.hint, path=exc.path,
                        line=exc.line)


def redact(text: str, token: str | None) -> str:
    """`text` without the token, nor anything that looks like one (`hf_...`)."""
    if token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)
