"""`model:` — which weights to train."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from shardtune.catalog.models import MODELS
from shardtune.config.base import _Section
from shardtune.errors import suggest

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelConfig(_Section):
    name: str = Field("tiny-llama", description="Catalogue name (e.g. llama-3-8b, tiny-llama), a local HF "
                                                "model folder, or a Hub model id (owner/name) already in the local "
                                                "Hugging Face cache ($HF_HUB_CACHE; read offline, never downloaded).")
    init: Literal["auto", "random", "pretrained"] = Field(
        "auto", description="auto: load safetensors weights when `name` is a folder that has them, else seeded "
                            "random init.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model folder. Off "
                                                       "unless you ask.")
    architecture: str | None = Field(
        None, description="Catalogue architecture of the folder in `name` (e.g. llama-3-8b): `plan` and `launch` "
                          "use it where the folder is not on this machine; training checks the folder against it.")
    download: str | None = Field(None, description="Hub id the folder in `name` comes from "
                                                   "(owner/name): a missing folder's error names its download "
                                                   "command.")

    @field_validator("name")
    @classmethod
    def _cached_id(cls, v: str) -> str:
        """A Hub id (owner/name) that is no folder here but is in the local Hugging Face cache: its
        snapshot folder (offline, like data.path's dataset ids)."""
        if v not in MODELS and _HUB_ID.fullmatch(v) and not Path(v).expanduser().exists():
            from shardtune.config.paths import cached_model_folder

            return cached_model_folder(v) or v
        return v

    @field_validator("architecture")
    @classmethod
    def _known(cls, v):
        if v is not None and v not in MODELS:
            raise ValueError(f"{v!r} is not a catalogue architecture{suggest(v, MODELS)}; "
                             f"one of {', '.join(sorted(MODELS))}")
        return v

    @field_validator("download")
    @classmethod
    def _hub_id(cls, v):
        if v is not None and not _HUB_ID.fullmatch(v):
            raise ValueError(f"{v!r} is not a Hub id; give owner/name, e.g. meta-llama/Meta-Llama-3-8B-Instruct")
        return v

    @property
    def is_absent_folder(self) -> bool:
        """`name` is a path (not a catalogue name) that does not exist on this machine."""
        return self.name not in MODELS and not Path(self.name).expanduser().exists()

    def plan_name(self) -> str:
        """What the planner reads: `name`, or `architecture` when that folder is not on this machine."""
        return self.architecture if self.architecture and self.is_absent_folder else self.name

    def download_hint(self) -> str:
        """The command that fetches the folder, when the recipe names its Hub id ('' otherwise)."""
        if not self.download:
            return ""
        return (f"; download it first: hf download {self.download} --exclude 'original/*' "
                f"--local-dir {shlex.quote(self.name)}")
