"""Params: load the pipeline's params.yaml, apply the active profile, validate each stage's section.

Layout of a params file (root `params.yaml`, and `pipelines/<slug>/params.yaml` for a paper):

    profile: cpu                 # smoke | cpu | gpu, a tracked DVC parameter (root file only)
    seed: 0
    paths: {...}                 # every input/output path, declared once, interpolated into dvc.yaml
    <stage>: {...}               # the stage's hyperparameters (values shared by every profile)
    profiles:
      smoke: {<stage>: {...}}    # per-profile overrides of the stage's section
      cpu:   {<stage>: {...}}
      gpu:   {<stage>: {...}}

A stage's `dvc.yaml` entry lists `<stage>` and `profiles.${profile}.<stage>` under `params`, so
switching the profile invalidates exactly the stages whose sizes depend on it.

Validation happens before any compute; a bad key fails with the file, the dotted key, the value
and what was expected.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

PROFILES = ("smoke", "cpu", "gpu")

T = TypeVar("T", bound=BaseModel)


class ParamsError(ValueError):
    """Malformed params: raised before any compute, with a message naming key, value and rule."""


class UnknownNameError(KeyError):
    """An unknown pipeline or stage name; the message carries a 'did you mean' suggestion."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def did_you_mean(name: str, choices: Iterable[str], kind: str) -> UnknownNameError:
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return UnknownNameError(f"unknown {kind} {name!r}.{hint} Known: {', '.join(choices)}.")


def find_root(start: str | Path | None = None) -> Path:
    """The repo root: the nearest folder upwards that holds `.dvc/` and `params.yaml`."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / ".dvc").is_dir() and (d / "params.yaml").is_file():
            return d
    raise FileNotFoundError(f"no paperline repo (a folder with .dvc/ and params.yaml) above {here}")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def active_profile(root_params: dict[str, Any], source: str = "params.yaml") -> str:
    profile = root_params.get("profile", "cpu")
    if profile not in PROFILES:
        raise ParamsError(
            f"{source}: profile = {profile!r}: expected one of {', '.join(PROFILES)}"
        )
    return profile


def section_for(params: dict[str, Any], section: str, profile: str, source: str) -> dict[str, Any]:
    """The stage's section with the active profile's overrides applied."""
    base = params.get(section, {})
    if base is None:
        base = {}
    if not isinstance(base, dict):
        raise ParamsError(f"{source}: {section} = {base!r}: expected a mapping of settings")
    profiles = params.get("profiles", {}) or {}
    override = (profiles.get(profile) or {}).get(section) or {}
    if not isinstance(override, dict):
        raise ParamsError(
            f"{source}: profiles.{profile}.{section} = {override!r}: expected a mapping of settings"
        )
    return deep_merge(base, override)


def format_validation_error(exc: ValidationError, section: str, values: dict[str, Any],
                            source: str, profile: str) -> str:
    lines = [f"{source}: invalid settings for stage {section!r} (profile {profile!r}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{section}.{loc}" if loc else section
        if err["type"] == "extra_forbidden":
            known = ""
            model_fields = err.get("ctx", {}).get("fields")
            if model_fields:
                known = f" (known: {', '.join(model_fields)})"
            lines.append(f"  {key} = {err.get('input')!r}: unknown key{known}")
        elif err["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key} = {err.get('input')!r}: {err['msg']}")
    return "\n".join(lines)


def validate_section(model: type[T], params: dict[str, Any], section: str, profile: str,
                     source: str) -> T:
    values = section_for(params, section, profile, source)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        # Name unknown keys with their close matches: the commonest slip is a typo.
        msg = format_validation_error(exc, section, values, source, profile)
        fields = list(model.model_fields)
        extra = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden" and e["loc"]]
        for name in extra:
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            if close:
                msg += f"\n  did you mean {section}.{close[0]!r} instead of {name!r}?"
        msg += f"\n  known keys of {section!r}: {', '.join(fields)}"
        raise ParamsError(msg) from None


def resolve_paths(paths: dict[str, Any], base_dir: Path, source: str) -> dict[str, Path]:
    if not isinstance(paths, dict):
        raise ParamsError(f"{source}: paths = {paths!r}: expected a mapping of name -> path")
    out: dict[str, Path] = {}
    for name, value in paths.items():
        if not isinstance(value, str) or not value:
            raise ParamsError(f"{source}: paths.{name} = {value!r}: expected a relative path string")
        p = Path(value)
        if p.is_absolute():
            raise ParamsError(f"{source}: paths.{name} = {value!r}: expected a path relative to "
                              f"the params file's folder")
        out[name] = (base_dir / p).resolve()
    return out
