"""Scenario files: TOML in, a frozen ``Scenario`` out, every mistake named by file and key.

Each section is a small keyword-only frozen dataclass; the loader checks unknown keys (with a
did-you-mean), types and allowed values, then cross-field rules. ``--set a.b=value`` overrides
go through the same checks.
"""

import difflib
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from sim.dtypes import canonical_dtype
from sim.errors import UserError
from sim.hardware.cluster_spec import ClusterSpec, load_cluster
from sim.hardware.registry import load_profile
from sim.scenario.checks import check_precision, check_scenario, scenario_warnings
from sim.scenario.finetune_check import check_finetune
from sim.scenario.hf_model import describe_config, library, library_entry, llama_config_file
from sim.scenario.sections import SECTIONS, ClusterSection, FinetuneSection, ModelSection, Scenario
from sim.workload.model import PRESETS, ModelConfig, preset

# model keys that are not a model's dimensions
NOT_DIMENSIONS = ("preset", "config", "use_cache", "output_format")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, name: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert (int -> float, str -> enum)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:  # tuple[str, ...]: a TOML list
        if not isinstance(value, list):
            raise UserError(f"{where}: {name} must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], name, where) for v in value)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return None
        for option in inner[:-1]:  # the first type that takes the value; the last names the error
            try:
                return _coerce(value, option, name, where)
            except UserError:
                pass
        return _coerce(value, inner[-1], name, where)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        allowed = [m.value for m in tp]
        matches = [m for m in tp if isinstance(value, str) and m.value.lower() == value.lower()]
        if not matches:
            raise UserError(f"{where}: {name} = {value!r} is not allowed; allowed: {', '.join(allowed)}")
        return matches[0]
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise UserError(f"{where}: {name} must be {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; allowed: {', '.join(options)}"


def _build_section(name: str, cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: [{name}] must be a table")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key in raw:
        if key not in known:
            raise UserError(f"{where}: unknown key {name}.{key}{_did_you_mean(key, known)}")
    values = {k: _coerce(v, hints[k], f"{name}.{k}", where) for k, v in raw.items()}
    return cls(**values)


def _described_model(section: ModelSection, built: dict[str, Any], where: str) -> ModelConfig | None:
    """A model from a config.json (``model.config``, or a library name in ``model.preset``); a
    hand-written preset fine-tuned with LoRA, from the Llama config of its dimensions (PEFT's
    adapters are measured on the real model)."""
    finetune = built["finetune"]
    if section.config is None and finetune.lora and (section.preset is None or section.preset in PRESETS):
        hand_written = _resolve_model(section, {**built, "finetune": FinetuneSection()}, where)
        path, name = llama_config_file(hand_written), hand_written.name
    elif section.config is not None:
        path = Path(where).parent / section.config
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    elif section.preset is not None and section.preset not in PRESETS:
        entry = library_entry(section.preset, where)
        if entry is None:
            return None
        path, name = entry.path, entry.name
    else:
        return None
    extra = [
        f"model.{f.name}"
        for f in fields(section)
        if f.name not in NOT_DIMENSIONS and getattr(section, f.name) is not None
    ]
    if section.config is None and (section.preset is None or section.preset in PRESETS):
        extra = []  # a hand-written model's dimensions, already applied
    if extra or (section.config is not None and section.preset is not None):
        raise UserError(
            f"{where}: a model from a config.json takes no other model keys (got {', '.join(extra) or 'model.preset'})"
        )
    training, precision = built["training"], built["precision"]
    description = describe_config(
        path,
        name=name,
        micro_batch=training.micro_batch,
        seq_len=training.seq_len,
        decoder_seq_len=training.decoder_seq_len,
        dtype=canonical_dtype(precision.param_dtype),
        where=where,
        finetune=finetune.settings(adapter_dtype=_own_adapter_dtype(built)) if finetune.lora else None,
    )
    return ModelConfig.of(description)


def _own_adapter_dtype(built: dict[str, Any]) -> str | None:
    """fp32 where LoRA's adapters compute in their own dtype over a lower-precision base: FSDP1
    without MixedPrecision (PEFT keeps them fp32, ``autocast_adapter_dtype``; nothing casts them)."""
    pure_fsdp1 = built["parallel"].fsdp_version == 1 and not built["fsdp1"].mixed_precision
    low = canonical_dtype(built["precision"].param_dtype) != "fp32"
    return "fp32" if pure_fsdp1 and low and not built["deepspeed"].enabled else None


def _resolve_model(section: ModelSection, built: dict[str, Any], where: str) -> ModelConfig:
    described = _described_model(section, built, where)
    if described is not None:
        return described
    dims = {f.name: getattr(section, f.name) for f in fields(section) if f.name not in NOT_DIMENSIONS}
    given = {k: v for k, v in dims.items() if v is not None}
    if section.preset is not None:
        if section.preset not in PRESETS:
            names = [*PRESETS, *library()]
            raise UserError(f"{where}: unknown model.preset {section.preset!r}; allowed: {', '.join(names)}")
        cfg = replace(preset(section.preset, where), **given)
        if given:
            cfg = replace(cfg, name=f"{cfg.name}*")
    else:
        required = [
            f.name
            for f in fields(ModelConfig)
            if f.default is MISSING and f.name not in given and f.name != "description"
        ]
        if required:
            raise UserError(f"{where}: model needs model.preset or all of: {', '.join(required)}")
        cfg = ModelConfig(name="custom", **given)
    cfg.check(where)
    return cfg


def _cluster(raw: Any, cluster: ClusterSection, where: str) -> tuple[ClusterSection, ClusterSpec | None]:
    """The cluster ``cluster.name`` names, read here once; its GPUs' profile when the scenario
    names no profile of its own."""
    if cluster.name is None:
        return cluster, None
    spec = load_cluster(cluster.name, where=f"{where}: cluster.name")
    if "profile" not in (raw if isinstance(raw, dict) else {}):
        cluster = replace(cluster, profile=spec.device_profile)
    return cluster, spec


def _gpus_per_node(cluster: ClusterSection, spec: ClusterSpec | None, where: str) -> int:
    """``cluster.gpus_per_node`` when given, else the cluster's, else the profile's (read here, once)."""
    if cluster.gpus_per_node is None and spec is not None:
        return spec.gpus_per_node
    if cluster.gpus_per_node is None:
        return load_profile(cluster.profile, where=f"{where}: cluster.profile").gpus_per_node
    if cluster.gpus_per_node <= 0:
        raise UserError(f"{where}: cluster.gpus_per_node must be > 0, got {cluster.gpus_per_node}")
    return cluster.gpus_per_node


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, else taken as a plain string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"--set {text!r}: expected section.key=value, e.g. parallel.world_size=64")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def scenario_from_dict(data: dict[str, Any], where: str, overrides: Sequence[str] = ()) -> Scenario:
    # a [sweep] table describes variants of this scenario; `fsdpsim sweep` reads it (sim.study.sweep.plan)
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items() if k != "sweep"}
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise UserError(
                f"--set {text!r}: unknown section {section!r}{_did_you_mean(section, list(SECTIONS))}"
            )
        if not isinstance(data.setdefault(section, {}), dict):
            raise UserError(f"{where}: [{section}] must be a table")
        data[section][key] = value
    for name in data:
        if name not in SECTIONS:
            raise UserError(f"{where}: unknown section [{name}]{_did_you_mean(name, list(SECTIONS))}")
    built = {name: _build_section(name, cls, data.get(name, {}), where) for name, cls in SECTIONS.items()}
    check_precision(built["precision"], where)
    check_finetune(built["finetune"], built["precision"].param_dtype, built["parallel"].fsdp_version, where)
    model_section = built.pop("model")
    model = _resolve_model(model_section, built, where)
    built["cluster"], spec = _cluster(data.get("cluster", {}), built["cluster"], where)
    scenario = Scenario(
        source=where,
        model=model,
        use_cache=model_section.use_cache,
        output_format=model_section.output_format,
        gpus_per_node=_gpus_per_node(built["cluster"], spec, where),
        cluster_spec=spec,
        **built,
    )
    check_scenario(scenario, where)
    return replace(scenario, warnings=scenario_warnings(scenario, where))


def read_scenario_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a scenario file (``[sweep]`` included), or a UserError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: scenario file not found")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    return scenario_from_dict(read_scenario_toml(path), str(path), overrides)
