"""The base of every config section: a frozen pydantic model that refuses unknown keys and wrong types."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)
