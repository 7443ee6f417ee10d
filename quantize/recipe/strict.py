"""The base of every declarative model (recipes, calibration specs, eval suites and their
metrics): strict (`extra="forbid"`: an unknown key is an error) and frozen, and the name
pattern every artifact shares.

Strict types as well (`strict=True`): a value must already be of its field's type, as YAML
(or JSON) writes it. A boolean is `true`/`false` (the text "yes" once turned remote code on),
an integer is a whole number (not `true`, not "8", not 8.0 or 2.5), a number is not text and
not a boolean; an integer is still a number. No number is infinite or NaN (`.inf`, `.nan`,
1e999): no setting means either. quantize/recipe/yamlio.py names the line, the field, the value
got and how to write it."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
