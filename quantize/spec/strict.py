"""The base of every declarative model (recipes, calibration specs, eval suites and their
metrics): strict (`extra="forbid"`: an unknown key is an error, with did-you-mean from
yamlio) and frozen, and the name pattern every artifact shares."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
