"""What publish prints: never rich markup by accident, never a token."""

from __future__ import annotations

import re

from quantize.progress import warn as _warn

_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{8,}")


def warn(msg: str) -> None:
    """A warning line; the text is escaped so that brackets in it are not rich markup."""
    from rich.markup import escape

    _warn(escape(msg))


def redact(text: str, token: str | None) -> str:
    """`text` without the token, nor anything that looks like one (`hf_...`)."""
    if token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)
