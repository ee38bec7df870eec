"""What the user asked for, per op slot: the model config's ``ops_implementation`` and the environment."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import SettingError
from .registry import SLOTS
from .shared_prefix.level_cost import ENV_LEVEL_COST, parse_level_cost
from .shared_prefix.plan import DEFAULT_MAX_DEPTH

AUTO = "auto"
ENV_PREFIX = "PATCHGEN_OPS_"
ENV_DEVICE_TARGET = "PATCHGEN_DEVICE_TARGET"


@dataclass
class OpsImplementationConfig:
    """One backend name per op slot; ``"auto"`` leaves the choice to the environment and the device."""

    gated_delta_rule: str = AUTO
    causal_conv1d: str = AUTO
    rms_norm_gated: str = AUTO
    rms_norm: str = AUTO
    rotary: str = AUTO
    swiglu_mlp: str = AUTO
    attention: str = AUTO
    cross_entropy: str = AUTO
    moe_experts: str = AUTO

    @classmethod
    def from_any(cls, source: Any) -> OpsImplementationConfig:
        """From None, this dataclass, a dict of slot -> backend, or a model config (``ops_implementation``,
        also under ``text_config``). Unknown slot names are an error, not silently ignored."""
        if source is None or isinstance(source, cls):
            return source or cls()
        if isinstance(source, Mapping):
            unknown = set(source) - set(SLOTS)
            if unknown:
                hints = "".join(_did_you_mean(name, SLOTS) for name in sorted(unknown))
                raise SettingError(
                    f"ops_implementation names unknown op slots {sorted(unknown)}{hints}; slots are {list(SLOTS)}"
                )
            return cls(**{slot: str(name) for slot, name in source.items()})
        for holder in (source, getattr(source, "text_config", None)):
            value = getattr(holder, "ops_implementation", None) if holder is not None else None
            if value is not None:
                return cls.from_any(value)
        if hasattr(source, "to_dict") or hasattr(source, "model_type"):
            return cls()  # a model config that asks for nothing
        raise TypeError(f"cannot read ops_implementation from {type(source).__name__}")


def env_var(slot: str) -> str:
    """``PATCHGEN_OPS_<SLOT>``, e.g. ``PATCHGEN_OPS_GATED_DELTA_RULE``."""
    return ENV_PREFIX + slot.upper()


def from_env(slot: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The backend the environment asks for, or None when unset, empty or ``auto``."""
    value = (os.environ if environ is None else environ).get(env_var(slot), "").strip()
    return value if value and value != AUTO else None


# fla's switches, read when kernels/backends/fla.py is imported: any value but "0" leaves the path on, so
# `false` or a misspelt name would silently keep it
FLA_ENV_VARS = ("PATCHGEN_FLA_JOINT_ROUNDS", "PATCHGEN_FLA_CONV_LOOK_BACK")


def _check_switch(key: str, value: str, known) -> None:
    if key not in known:
        raise SettingError(
            f"environment variable {key}={value!r} is not one patchgen reads{_did_you_mean(key, known)}; "
            f"the fla switches are {', '.join(known)}: rename or unset it"
        )
    if value.strip() not in ("", "0", "1"):
        raise SettingError(f"environment variable {key}={value!r}: expected 1 (on) or 0 (off), or unset it")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a ``PATCHGEN_OPS_*`` (or ``PATCHGEN_OP_*``) variable that names no op slot, a
    ``PATCHGEN_SHARED_PREFIX_*`` one that names no shared-prefix setting, and a ``PATCHGEN_FLA_*`` one
    that is not one of fla's switches or holds anything but 0 or 1.

    A misspelt variable would otherwise be ignored: ``auto`` would silently pick another kernel, a
    shared-prefix setting would silently keep its default. Read when op slots are resolved (a model's build).
    """
    environ = os.environ if environ is None else environ
    known = [env_var(slot) for slot in SLOTS]
    for key in sorted(environ):
        if key.startswith("PATCHGEN_OP") and key != "PATCHGEN_OP_DEFAULTS" and key not in known:
            raise SettingError(
                f"environment variable {key}={environ[key]!r} names no op slot{_did_you_mean(key, known)}; "
                f"the op-slot variables are {ENV_PREFIX}<SLOT> for the slots {', '.join(SLOTS)}: rename or unset it"
            )
        if key.startswith("PATCHGEN_FLA"):
            _check_switch(key, environ[key], FLA_ENV_VARS)
        # PATCHGEN_SHARED, not the whole prefix: a typo inside the prefix (PATCHGEN_SHARED_PERFIX_...) is caught too
        if key.startswith("PATCHGEN_SHARED") and key not in SHARED_PREFIX_ENV_VARS:
            raise SettingError(
                f"environment variable {key}={environ[key]!r} is not one patchgen reads{_shared_prefix_hint(key)}; "
                f"the shared-prefix variables are {', '.join(SHARED_PREFIX_ENV_VARS)} (the other shared_prefix_* "
                "settings are model config fields): rename or unset it"
            )


# Model config fields patchgen reads (on the text config), with their defaults.
SHARED_PREFIX_TRAINING = "shared_prefix_training"
SHARED_PREFIX_MIN_LENGTH = "shared_prefix_min_length"
SHARED_PREFIX_VERIFY = "shared_prefix_verify"
SHARED_PREFIX_CHUNK_ALIGNED = "shared_prefix_chunk_aligned"
SHARED_PREFIX_CUDA_GRAPHS = "shared_prefix_cuda_graphs"
SHARED_PREFIX_CUDA_GRAPHS_CACHE = "shared_prefix_cuda_graphs_cache"
SHARED_PREFIX_CUDA_GRAPHS_BUCKETS = "shared_prefix_cuda_graphs_buckets"
SHARED_PREFIX_PLAN_REUSE = "shared_prefix_plan_reuse"
SHARED_PREFIX_CUDA_GRAPHS_SCORING = "shared_prefix_cuda_graphs_scoring"
SHARED_PREFIX_CUDA_GRAPHS_TRAINING = "shared_prefix_cuda_graphs_training"
# how a kind of forward runs its layer stack while the graphs are on: a graph replay on a padded plan, eagerly on
# the unpadded plan, or per call the way measured faster (`graphs/choice.py`)
GRAPHS_WAYS = ("graphs", "eager", "auto")
SCORING_MODES = GRAPHS_WAYS  # the name the bench reads
ENV_SHARED_PREFIX_CUDA_GRAPHS = "PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS"
SHARED_PREFIX_ENV_VARS = (ENV_SHARED_PREFIX_CUDA_GRAPHS, ENV_LEVEL_COST)
BOOL_FIELDS = (
    SHARED_PREFIX_TRAINING,
    SHARED_PREFIX_VERIFY,
    SHARED_PREFIX_CHUNK_ALIGNED,
    SHARED_PREFIX_CUDA_GRAPHS,
    SHARED_PREFIX_CUDA_GRAPHS_BUCKETS,
    SHARED_PREFIX_PLAN_REUSE,
)
SHARED_PREFIX_MAX_DEPTH = "shared_prefix_max_depth"
SHARED_PREFIX_LEVEL_COST = "shared_prefix_level_cost"
# Whole-number fields: name -> (default, smallest value allowed, what it counts).
INT_FIELDS = {
    SHARED_PREFIX_MIN_LENGTH: (64, 1, "the shortest prefix worth sharing, in tokens"),
    SHARED_PREFIX_MAX_DEPTH: (DEFAULT_MAX_DEPTH, 1, "levels of nested prefixes shared (1: one level)"),
    SHARED_PREFIX_CUDA_GRAPHS_CACHE: (2, 1, "captured layer-stack graphs kept at once, each with its memory pool"),
}
FIELDS = (
    *BOOL_FIELDS, *INT_FIELDS, SHARED_PREFIX_LEVEL_COST, SHARED_PREFIX_CUDA_GRAPHS_SCORING,
    SHARED_PREFIX_CUDA_GRAPHS_TRAINING, "ops_implementation",
)


_UNSET = object()


def field(config: Any, name: str, default: Any = None) -> Any:
    """A patchgen field of a model config: on its ``text_config``, or on the config itself.

    ``model.config.shared_prefix_training = True`` on a vision-language class lands on the composite
    config, not on its text config; both places are read, so the flag is never silently ignored.
    The same field set to different values in both places is an error.
    """
    text = _read(config, "text_config", None)
    if text is None:
        return _read(config, name, default)
    inner, outer = _read(text, name, _UNSET), object.__getattribute__(config, "__dict__").get(name, _UNSET)
    if inner is not _UNSET and outer is not _UNSET and inner != outer:
        raise SettingError(
            f"config field {name} is {outer!r} on the composite config and {inner!r} on its text_config; patchgen "
            f"reads one value: set it in one place (model.config.text_config.{name} = ...)"
        )
    value = inner if inner is not _UNSET else outer
    return default if value is _UNSET else value


def _read(config: Any, name: str, default: Any) -> Any:
    """``getattr(config, name, default)`` without the instance's ``__getattribute__`` where it changes nothing. A
    transformers config reads every attribute through two overrides of it (the attribute map, per-layer configs), and
    a field left unset through a raised AttributeError: about 15 us a read on the 2-core CPU machine, 0.35 ms a plan
    for the twenty-odd fields `plan_for` reads (fourteenth session, docs/bench). A
    field set on the config is in its ``__dict__``; one set nowhere is in neither that nor its class. Names the
    attribute map renames, class attributes (a property), per-layer fields of a heterogeneous config and every field
    of a class that looks fields up its own way (a wrapper's ``__getattr__`` or ``__getattribute__``) take
    ``getattr``."""
    cls = type(config)
    if not _plain_lookup(cls):
        return getattr(config, name, default)
    try:
        own = object.__getattribute__(config, "__dict__")  # `vars()` would go through the overrides too
    except AttributeError:
        return getattr(config, name, default)
    if name in getattr(cls, "attribute_map", ()) or own.get("_heterogeneity_spec") is not None:
        return getattr(config, name, default)
    in_class = getattr(cls, name, _UNSET)
    if in_class is _UNSET:
        return own.get(name, default)
    if name in own and not _is_data_descriptor(in_class):
        return own[name]
    return getattr(config, name, default)


_PLAIN_LOOKUP: dict[type, bool] = {}


def _plain_lookup(cls: type) -> bool:
    """Whether instances of `cls` find an attribute in their ``__dict__`` and class only: ``object``'s lookup or
    transformers' config lookup (an attribute map, per-layer fields, both left to ``_read``), and no ``__getattr__``
    for what neither holds."""
    plain = _PLAIN_LOOKUP.get(cls)
    if plain is None:
        lookup = cls.__getattribute__
        plain = _PLAIN_LOOKUP[cls] = not hasattr(cls, "__getattr__") and (
            lookup is object.__getattribute__
            or (getattr(lookup, "__module__", None) == "transformers.configuration_utils"
                and getattr(lookup, "__qualname__", "").endswith("Config.__getattribute__"))
        )
    return plain


def _is_data_descriptor(found: Any) -> bool:
    """Whether a class attribute wins over an instance's ``__dict__`` entry of its name (a property does)."""
    kind = type(found)
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


def bool_field(config: Any, name: str) -> bool:
    """A True/False field of ``BOOL_FIELDS`` from a model config (``field``; False when unset), checked: set after the
    model was built (``model.config.shared_prefix_training = "false"``) it is read here, where a string would be
    truthy."""
    flag = field(config, name, False)
    if not isinstance(flag, bool):
        raise SettingError(f"config field {name} must be True or False, got {flag!r}: set config.{name} = True or False")
    return flag


def int_field(config: Any, name: str) -> int:
    """A whole-number field of ``INT_FIELDS`` from a model config (``field``; its default when unset), checked."""
    default, smallest, meaning = INT_FIELDS[name]
    value = field(config, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
        raise SettingError(
            f"config field {name} must be a whole number >= {smallest} ({meaning}), got {value!r}: "
            f"set e.g. config.{name} = {default}"
        )
    return value


def shared_prefix_level_cost(config: Any) -> int | None:
    """``shared_prefix_level_cost``: rows one more tree level must save (an int >= 0), or None for
    ``"auto"`` / unset, the figure measured for the device (``shared_prefix/level_cost.py``)."""
    return parse_level_cost(field(config, SHARED_PREFIX_LEVEL_COST, None), f"config field {SHARED_PREFIX_LEVEL_COST}")


def shared_prefix_min_length(config: Any) -> int:
    """``shared_prefix_min_length`` (default 64): the shortest prefix worth sharing, in tokens."""
    return int_field(config, SHARED_PREFIX_MIN_LENGTH)


def shared_prefix_cuda_graphs_buckets(config: Any) -> bool:
    """``shared_prefix_cuda_graphs_buckets`` (default True): with the graphs on, pad training plans to bucket
    counts so that one graph serves every layout of a bucket (False: graphs key on the exact layout)."""
    flag = field(config, SHARED_PREFIX_CUDA_GRAPHS_BUCKETS, True)
    if not isinstance(flag, bool):
        raise SettingError(f"config field {SHARED_PREFIX_CUDA_GRAPHS_BUCKETS} must be True or False, got {flag!r}")
    return flag


def shared_prefix_cuda_graphs_scoring(config: Any) -> str:
    """``shared_prefix_cuda_graphs_scoring`` (default ``"auto"``): with the graphs on, how a scoring forward (no
    gradient) runs its layer stack. ``"auto"``: per call, the way this model has measured faster (`graphs/choice.py`);
    ``"graphs"``: always a graph replay on a plan padded to a bucket; ``"eager"``: always eagerly on the unpadded
    plan (the graphs serve training steps only), the faster where many tokens a call keep the device busier than the
    eager launches keep the host (docs/cuda_graphs.md, "Scoring forwards" and "Replay or eager")."""
    return _graphs_way(config, SHARED_PREFIX_CUDA_GRAPHS_SCORING)


def shared_prefix_cuda_graphs_training(config: Any) -> str:
    """``shared_prefix_cuda_graphs_training`` (default ``"auto"``): with the graphs on, how a training step runs its
    layer stack: ``"auto"`` (per call, the way this model has measured faster), ``"graphs"`` (always forward and
    backward replays on a padded plan) or ``"eager"`` (always the unpadded plan, eagerly; the graphs serve scoring
    forwards only)."""
    return _graphs_way(config, SHARED_PREFIX_CUDA_GRAPHS_TRAINING)


DEFAULT_GRAPHS_WAY = "auto"  # measured on the H200 under RL-like variation: docs/cuda_graphs.md, "Replay or eager"


def _graphs_way(config: Any, name: str) -> str:
    value = field(config, name, DEFAULT_GRAPHS_WAY)
    if value not in GRAPHS_WAYS:
        raise SettingError(
            f"config field {name} must be one of {', '.join(map(repr, GRAPHS_WAYS))}, got {value!r}: set e.g. "
            f"config.{name} = 'auto'"
        )
    return value


def shared_prefix_plan_reuse(config: Any) -> bool:
    """``shared_prefix_plan_reuse`` (default True): a micro-batch equal by value to one of the last few gets their
    plan again instead of a new build (`shared_prefix/plan_reuse.py`: RL scores and trains on the same batch)."""
    flag = field(config, SHARED_PREFIX_PLAN_REUSE, True)
    if not isinstance(flag, bool):
        raise SettingError(f"config field {SHARED_PREFIX_PLAN_REUSE} must be True or False, got {flag!r}")
    return flag


def shared_prefix_cuda_graphs(config: Any, environ: Mapping[str, str] | None = None) -> bool:
    """``shared_prefix_cuda_graphs`` (default False), or ``PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS=1`` in the environment.

    The variable turns the feature on or off for every model (``0`` wins over the config); any other
    value is an error rather than silently ignored.
    """
    value = (os.environ if environ is None else environ).get(ENV_SHARED_PREFIX_CUDA_GRAPHS, "").strip()
    if value in ("1", "0"):
        return value == "1"
    if value:
        raise SettingError(
            f"environment variable {ENV_SHARED_PREFIX_CUDA_GRAPHS}={value!r}: expected 1 (on) or 0 (off); "
            "unset it to follow the model config's shared_prefix_cuda_graphs"
        )
    flag = field(config, SHARED_PREFIX_CUDA_GRAPHS, False)
    if not isinstance(flag, bool):  # set after the build's check: "false" would read as on
        raise SettingError(f"config field {SHARED_PREFIX_CUDA_GRAPHS} must be True or False, got {flag!r}")
    return flag


def check_model_config(config: Any) -> None:
    """Validate the patchgen fields of a model config (and its ``text_config``) at model build time.

    Catches a wrong value (``shared_prefix_training="yes"``) and a field name one typo away from ours
    (``shared_prefix_trainig``), which the config class would otherwise keep silently.
    """
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None or not hasattr(holder, "to_dict"):
            continue
        for name in BOOL_FIELDS:
            flag = getattr(holder, name, False)
            if not isinstance(flag, bool):
                raise SettingError(f"config field {name} must be True or False, got {flag!r}")
        for name in INT_FIELDS:
            if hasattr(holder, name):
                int_field(holder, name)
        if hasattr(holder, SHARED_PREFIX_LEVEL_COST):
            shared_prefix_level_cost(holder)
        for name in (SHARED_PREFIX_CUDA_GRAPHS_SCORING, SHARED_PREFIX_CUDA_GRAPHS_TRAINING):
            if hasattr(holder, name):
                _graphs_way(holder, name)
        for key in vars(holder):
            if key not in FIELDS and (close := difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.85)):
                raise SettingError(
                    f"config field {key!r} is not one patchgen reads; did you mean {close[0]!r}? Rename it."
                )


def store_ops_implementation_as_dict(config: Any) -> None:
    """Replace an ``OpsImplementationConfig`` set as a config's ``ops_implementation`` by its dict of slot names.

    transformers writes the config as JSON (``save_pretrained``, every Trainer checkpoint), which a dataclass
    instance is not: the save would fail at the end of a run. The dict selects the same backends.
    """
    for holder in (config, getattr(config, "text_config", None)):
        value = getattr(holder, "ops_implementation", None) if holder is not None else None
        if isinstance(value, OpsImplementationConfig):
            holder.ops_implementation = {slot: name for slot, name in asdict(value).items() if name != AUTO}


def _shared_prefix_hint(variable: str) -> str:
    """What a misspelt ``PATCHGEN_SHARED_PREFIX_*`` variable was likely meant to be: a config field written as a
    variable, else the variable one typo away (the 0.85 cutoff of the config-field check: the long common prefix
    makes every name look close at 0.6)."""
    field_name = "shared_prefix_" + variable.removeprefix("PATCHGEN_SHARED_PREFIX_").lower()
    if field_name in FIELDS:
        return f" ({field_name} is a model config field, not a variable: set config.{field_name})"
    close = difflib.get_close_matches(variable, SHARED_PREFIX_ENV_VARS, n=1, cutoff=0.85)
    return f" (did you mean {close[0]}?)" if close else ""


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
