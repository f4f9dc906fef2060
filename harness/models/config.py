"""configs/models.yaml: the models the harness knows, validated."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.models.rules import gqa_problem

MODELS_YAML = REPO_ROOT / "configs" / "models.yaml"


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    hub_id: str | None = None
    description: str | None = None
    attention_heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    params_b: float | None = Field(
        default=None, gt=0
    )  # parameters in billions, for GPU memory planning (harness/gpu/plan.py)
    gsm8k_expected: float | None = Field(default=None, ge=0, le=1)
    gated: bool = False  # the hub serves it only with a token whose account accepted its license (doctor names it)
    # The KV cache's shape beyond the heads (harness/models/heads.py); a hub_id-less entry is built by
    # harness/models/tiny.py spec_for_model_entry from these.
    family: str | None = Field(default=None, min_length=1)  # config.json model_type, or a tiny family (tiny.FAMILIES)
    head_dim: int | None = Field(default=None, ge=1)  # per KV head; MLA: kv_lora_rank + qk_rope_head_dim
    sliding_window: int | None = Field(default=None, ge=1)  # tokens, where some or all layers slide
    mla: bool = False  # multi-head latent attention: one latent KV head replicated on every TP rank, K is moot

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelEntry:
        problem = gqa_problem(self.attention_heads, self.kv_heads)
        if problem:
            raise ValueError(problem)
        return self


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[ModelEntry]

    @model_validator(mode="after")
    def _unique(self) -> ModelsFile:
        require_unique_ids([m.id for m in self.models], "model")
        return self

    def find(self, name: str, files: bool = True) -> ModelEntry | None:
        """By id, hub id, or a local folder named like either; else (``files``) a model of this machine's files
        (``entry_from_files``), so that a hub model that is not listed can still be planned."""
        base = Path(name).name
        for m in self.models:
            if name in (m.id, m.hub_id) or base in (m.id, (m.hub_id or "").split("/")[-1]):
                return m
        return entry_from_files(name) if files else None


def entry_from_files(model: str) -> ModelEntry | None:
    """An entry for a model of a local folder or of the local Hugging Face cache: heads and shape from its config.json,
    params_b from its safetensors headers (None when they cannot be read). ``hub_id`` stays None: it is no listed
    model, so nothing that needs one (the "Paris" smoke check, a published GSM8K score) applies. None: not here."""
    from harness.models.hub import config_shape, locate, read_config, weights

    cfg = read_config(model)
    loc = locate(model)
    if cfg is None or loc is None:
        return None
    shape = config_shape(cfg)
    w = weights(loc.folder)
    where = "the local Hugging Face cache" if loc.from_cache else "a local folder"
    heads, kv_heads = shape["attention_heads"], shape["kv_heads"]
    if heads is None or kv_heads is None:  # a config without heads: the preflight says what is wrong
        return None
    try:
        return ModelEntry(
            id=Path(model).name,
            description=f"read from {where}: {loc.folder}",
            attention_heads=heads,
            kv_heads=kv_heads,
            params_b=w.params / 1e9 if w and w.params else None,
            family=shape["family"],
            head_dim=shape["head_dim"],
            sliding_window=shape["sliding_window"],
            mla=shape["mla"],
        )
    except ValidationError:  # a config without heads (or inconsistent ones): the preflight says what is wrong
        return None


def require_unique_ids(ids: list[str], what: str) -> None:
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"duplicate {what} id {i!r}")
        seen.add(i)


def _flat(text: str) -> str:
    return " ".join(str(text).split())


def one_line(e: ValidationError, path: Path) -> str:
    """The first validation error as one line: file, field, message (and how many more there are)."""
    errors = e.errors()
    err = errors[0]
    loc = ".".join(str(x) for x in err["loc"]) or "<top>"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {loc}: {_flat(err['msg'])}{more}"


def yaml_error_line(e: Exception, path: Path) -> str:
    """A YAML syntax or read error as one line naming the file (and the line where YAML knows it)."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(e, "problem", None) or (e.strerror if isinstance(e, OSError) and e.strerror else str(e))
    return f"{path}:{where}: {_flat(what)}" if where else f"{path}: {_flat(what)}"


M = TypeVar("M", bound=BaseModel)


def load_yaml(path: Path, model: type[M]) -> M:
    """A YAML config validated as ``model``; any problem is one ConfigError line naming the file (and field)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(yaml_error_line(e, path)) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(one_line(e, path)) from None


def load_models(path: Path = MODELS_YAML) -> ModelsFile:
    return load_yaml(path, ModelsFile)
