"""Params: load the pipeline's params.yaml, apply the active profile, validate each stage's section.

Layout of a params file (root `params.yaml`, and `pipelines/<slug>/params.yaml` for a paper):

    profile: cpu                 # smoke | cpu | gpu, a tracked DVC parameter (root file only)
    seed: 0
    storage: {...}               # the S3 bucket (root file only, see storage.py)
    paths: {...}                 # every input/output path, declared once, interpolated into dvc.yaml
    shared_sections: [rl_common] # sections no stage reads by name: YAML anchors merged into stages
    rl_common: &rl {...}         # ... used as `grpo: {<<: *rl, ...}`
    <stage>: {...}               # the stage's hyperparameters (values shared by every profile)
    profiles:
      smoke: {<stage>: {...}}    # per-profile overrides of the stage's section
      cpu:   {<stage>: {...}}
      gpu:   {<stage>: {...}}

A stage's `dvc.yaml` entry lists `<stage>` and `profiles.${profile}.<stage>` under `params`, so
switching the profile invalidates exactly the stages whose sizes depend on it.

Every top-level section must be one of: a stage of the file's pipeline (the root file: the shared
stages of the pipeline `base`), a contract section above (`profile`, `seed` and `storage` in the
root file only), or a name listed in the file's own `shared_sections`. Anything else is a typo
that would otherwise leave the code defaults silently in force, so it is an error with a
suggestion; the same holds for the stage names under `profiles.<profile>`.

Validation happens before any compute; a bad key fails with the file, the dotted key, the value
and what was expected.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

PROFILES = ("smoke", "cpu", "gpu")
# Top-level sections the contract defines besides the stages' own (see the module docstring).
ROOT_SECTIONS = ("profile", "seed", "storage", "paths", "shared_sections", "profiles")
PIPELINE_SECTIONS = ("paths", "shared_sections", "profiles")

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


# --- arm lists of a compare stage (pydantic validator bodies) -------------------------------

def unique_arms(arms: list[str]) -> list[str]:
    """An arm list names each arm once."""
    if len(set(arms)) != len(arms):
        raise ValueError(f"arms {arms} list an arm twice")
    return arms


def check_arm(field: str, arm: str | None, arms: list[str], baseline: str | None = None) -> None:
    """The arm a config field names is one of `arms` (and, with a baseline, not the baseline);
    None (untested) and an empty `arms` (that family not run) pass."""
    if arm is None or not arms:
        return
    if baseline is None and arm not in arms:
        raise ValueError(f"{field} {arm!r} is not one of the arms {arms}")
    if baseline is not None and (arm not in arms or arm == baseline):
        raise ValueError(f"{field} {arm!r} must be one of the arms {arms} other than the "
                         f"baseline {baseline!r}")


def disjoint_arms(a: list[str], b: list[str], what: str) -> None:
    """No arm is listed in two families (`what` names them, e.g. 'SFT and RL')."""
    if set(a) & set(b):
        raise ValueError(f"{sorted(set(a) & set(b))} are listed as both {what} arms")


def find_root(start: str | Path | None = None) -> Path:
    """The repo root: the nearest folder upwards that holds `.dvc/` and `params.yaml`."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / ".dvc").is_dir() and (d / "params.yaml").is_file():
            return d
    raise FileNotFoundError(f"no paperline repo (a folder with .dvc/ and params.yaml) above {here}")


# libyaml's parser where PyYAML has it (the same constructor, so the same values): params are
# read by every stage and, in `paperline repro`, for every stage of a pipeline (22 params files:
# 0.39 s in pure Python, 0.04 s with libyaml, on these 2 cores)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_LOADER) or {}
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


def check_sections(params: dict[str, Any], stages: Iterable[str], source: str, *,
                   root_file: bool) -> list[str]:
    """Errors for top-level sections (and `profiles.<profile>.<name>` keys) that no stage of the
    file reads: a misspelled `featuresX:` would otherwise leave the code defaults in force."""
    stages = list(stages)
    errors: list[str] = []
    shared = params.get("shared_sections") or []
    if not isinstance(shared, list) or not all(isinstance(n, str) for n in shared):
        errors.append(f"{source}: shared_sections = {shared!r}: expected a list of section names")
        shared = []
    contract = ROOT_SECTIONS if root_file else PIPELINE_SECTIONS
    for name in shared:
        if name in stages or name in ROOT_SECTIONS:
            errors.append(f"{source}: shared_sections lists {name!r}, which is a stage or a "
                          f"contract section, not a shared one")
        elif name not in params:
            errors.append(f"{source}: shared_sections lists {name!r}, but the file has no such "
                          f"section")
    known = [*stages, *contract, *shared]
    for name in params:
        if name in known:
            continue
        if not root_file and name in ("profile", "seed", "storage"):
            errors.append(f"{source}: {name!r} is set in the root params.yaml only (a pipeline's "
                          f"file cannot override it); from this folder: "
                          f"dvc exp run -S ../../params.yaml:{name}=<value>")
            continue
        hint = did_you_mean(str(name), known, "section")
        errors.append(f"{source}: {hint} A section that no stage reads by its name (a YAML "
                      f"anchor) must be listed in `shared_sections`.")
    profiles = params.get("profiles") or {}
    if not isinstance(profiles, dict):
        return [*errors, f"{source}: profiles = {profiles!r}: expected a mapping "
                         f"profile -> stage -> settings"]
    for profile, overrides in profiles.items():
        if profile not in PROFILES:
            hint = did_you_mean(str(profile), PROFILES, "profile")
            errors.append(f"{source}: profiles.{profile}: {hint}")
            continue
        if not isinstance(overrides, dict):
            if overrides is not None:
                errors.append(f"{source}: profiles.{profile} = {overrides!r}: expected a mapping "
                              f"stage -> settings")
            continue
        for name in overrides:
            if name not in stages:
                hint = did_you_mean(str(name), stages, "stage")
                errors.append(f"{source}: profiles.{profile}.{name}: {hint} Profile overrides "
                              f"apply to stage sections only.")
    return errors


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
        # An unknown key inside a nested model or a list item is compared with that item's own
        # fields (`arms.5.tau` -> `tau_r`), not with the stage's top-level keys.
        for err in exc.errors():
            if err["type"] != "extra_forbidden" or not err["loc"]:
                continue
            *parent, name = [str(p) for p in err["loc"]]
            owner = model_at(model, err["loc"][:-1])
            if owner is None:
                continue
            close = difflib.get_close_matches(name, list(owner.model_fields), n=1, cutoff=0.6)
            if close:
                where = ".".join([section, *parent])
                msg += (f"\n  did you mean {close[0]!r} ({where}.{close[0]}) instead of "
                        f"{name!r}?")
            if parent:
                msg += (f"\n  known keys of {'.'.join([section, *parent])}: "
                        f"{', '.join(owner.model_fields)}")
        msg += f"\n  known keys of {section!r}: {', '.join(model.model_fields)}"
        raise ParamsError(msg) from None


def model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `loc` (a validation error's location minus its
    last part): follows fields, list/tuple items, dict values and Optional; None if ambiguous."""
    node: Any = model
    for part in loc:
        node = _strip(node)
        if inspect.isclass(node) and issubclass(node, BaseModel):
            if not isinstance(part, str) or part not in node.model_fields:
                return None
            node = node.model_fields[part].annotation
            continue
        origin, args = typing.get_origin(node), typing.get_args(node)
        if origin in (list, tuple, set, frozenset) and args and isinstance(part, int):
            node = args[0]
        elif origin is dict and len(args) == 2:
            node = args[1]
        else:
            return None
    node = _strip(node)
    return node if inspect.isclass(node) and issubclass(node, BaseModel) else None


def _strip(annotation: Any) -> Any:
    """`X | None`, `Optional[X]` and `Annotated[X, ...]` -> X; other unions stay as they are."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _strip(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


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
