"""Per-model speculation settings the admin page edits, persisted to a JSON file.

Stage: server configuration. At start the server reads the file (if present) and its entries
override the command line's speculation for those models, so a setting made on the admin page
survives a restart; every change made on the page is written back atomically (temp file +
rename: a crash never leaves half a file). A malformed file stops the start-up with a message
naming the file and the field, rather than being silently replaced.

File format: {"version": 1, "models": {"<model>": {"enabled": true, "method": "draft",
"draft_model": "qwen2.5-coder-0.5b", "num_draft_tokens": 5}}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quickdraft.config import SPEC_METHODS, SpeculativeConfig

METHODS = tuple(m for m in SPEC_METHODS if m != "none")  # "off" is `enabled: false`


class SpeculationSettings(BaseModel):
    """What the admin page controls for one model. `method` is the method used when `enabled`
    (kept while speculation is off, so switching it back on restores the choice)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    enabled: bool
    method: str
    draft_model: str | None = None
    num_draft_tokens: int = Field(ge=1, le=32)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
        return method

    @classmethod
    def of(cls, config: SpeculativeConfig, default_draft: str | None = None) -> SpeculationSettings:
        method = config.method if config.method != "none" else "ngram"
        return cls(
            enabled=config.enabled,
            method=method,
            draft_model=config.draft_model or default_draft,
            num_draft_tokens=max(1, config.num_draft_tokens),
        )

    def apply(self, base: SpeculativeConfig) -> SpeculativeConfig:
        """The engine config: `base` (n-gram sizes, adaptive k) with these settings on top.
        ValueError (from SpeculativeConfig) when they do not make a valid config."""
        return dataclasses.replace(
            base,
            method=self.method if self.enabled else "none",
            draft_model=self.draft_model,
            num_draft_tokens=self.num_draft_tokens,
        )


class SettingsFile(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    version: Literal[1] = 1  # a new format gets a new number and a migration
    models: dict[str, SpeculationSettings] = Field(default_factory=dict)


def load_settings(path: Path) -> dict[str, SpeculationSettings]:
    """The saved settings per model ({} when the file does not exist yet)."""
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
        return SettingsFile.model_validate(raw).models
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"settings file {path} is not valid: {exc}") from None


def save_settings(path: Path, models: dict[str, SpeculationSettings]) -> None:
    """Write all models' settings atomically (entries for models not served now are kept)."""
    merged = {**load_settings_lenient(path), **models}
    text = SettingsFile(models=merged).model_dump_json(indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_settings_lenient(path: Path) -> dict[str, SpeculationSettings]:
    try:
        return load_settings(path)
    except ValueError:  # validated at start; if it broke since, the served models' entries win
        return {}
