"""transformers' auto classes: make ``AutoModelFor*.from_pretrained`` build the generated classes.

``register("gpu")`` maps every auto class that upstream maps for a Qwen3.5 / Qwen3.5-MoE model type
(``qwen3_5``, ``qwen3_5_text``, ``qwen3_5_moe``, ``qwen3_5_moe_text``) to the generated class of
the same name for that device target. The configs stay upstream's, so nothing about the checkpoint
changes; ``unregister()`` restores upstream's classes. docs/loading.md.
"""

from __future__ import annotations

import importlib

DEVICES = ("gpu", "npu")
MODELS = ("qwen3_5", "qwen3_5_moe")
MODEL_TYPES = {"qwen3_5": ("qwen3_5", "qwen3_5_text"), "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe_text")}


def generated_module(model: str, device: str):
    """The generated modeling module of one target, e.g. ``("qwen3_5", "gpu")``."""
    if device not in DEVICES:
        raise ValueError(f"patchgen.register: device must be one of {DEVICES}, got {device!r}")
    return importlib.import_module(f"patchgen.generated.{model}.patched_modeling_{model}_{device}")


def auto_classes() -> dict[str, type]:
    """transformers' model auto classes, by name (``AutoModel``, ``AutoModelForCausalLM``, ...)."""
    from transformers.models.auto import modeling_auto

    return {
        name: value
        for name, value in vars(modeling_auto).items()
        if name.startswith("AutoModel") and isinstance(getattr(value, "_model_mapping", None), modeling_auto._LazyAutoMapping)
    }


def register(device: str = "gpu") -> dict[str, dict[str, str]]:
    """Register the ``device`` target's generated classes with transformers' auto classes.

    Returns ``{auto class: {model_type: generated class name}}``, what now builds what. Calling it
    again with another device replaces the classes (one target per process).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    registered: dict[str, dict[str, str]] = {}
    for model in MODELS:
        module = generated_module(model, device)
        ours = set(getattr(module, "__all__", ()))
        for auto_name, auto_cls in auto_classes().items():
            names = auto_cls._model_mapping._model_mapping  # upstream's model_type -> class name table
            for model_type in MODEL_TYPES[model]:
                class_name = names.get(model_type)
                if class_name not in ours:
                    continue
                config_cls, model_cls = CONFIG_MAPPING[model_type], getattr(module, class_name)
                if model_cls.config_class is not config_cls:
                    model_cls = composite_loader(model_cls, config_cls)  # e.g. AutoModelForCausalLM of `qwen3_5`
                # The mapping's own register: AutoModelForCausalLM maps the VL config `qwen3_5` to
                # ForCausalLM (built from its text config), which the auto class's config check refuses.
                auto_cls._model_mapping.register(config_cls, model_cls, exist_ok=True)
                registered.setdefault(auto_name, {})[model_type] = f"{module.__name__}.{class_name}"
    return registered


class CompositeConfigLoader:
    """Stands in an auto-class mapping for a text class (``ForCausalLM``) keyed by a composite config.

    transformers' auto classes build such a class from ``config.get_text_config()``, dropping the patchgen
    fields set on the composite config (``shared_prefix_training``, ``ops_implementation``...). A loader
    declares the composite config as its own, so the auto class hands it the whole config, and builds the
    text class itself, whose ``_from_config`` / ``from_pretrained`` move those fields to the text config.
    The model built is an instance of the text class, never of the loader.
    """

    text_class: type

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls.text_class._from_config(config, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls.text_class.from_pretrained(*args, **kwargs)


_LOADERS: dict[tuple[type, type], type] = {}


def composite_loader(text_class: type, composite_config: type) -> type:
    """The ``CompositeConfigLoader`` of ``text_class`` for ``composite_config`` (one class per pair)."""
    key = (text_class, composite_config)
    if key not in _LOADERS:
        _LOADERS[key] = type(
            text_class.__name__,  # the name transformers' pipelines compare with a model's class name
            (CompositeConfigLoader, text_class),
            {"config_class": composite_config, "text_class": text_class, "__module__": __name__,
             "__doc__": f"{text_class.__module__}.{text_class.__name__} built from a {composite_config.__name__}"},
        )
    return _LOADERS[key]


def unregister() -> None:
    """Forget every generated class registered by ``register``: the auto classes build upstream's again."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    configs = {CONFIG_MAPPING[t] for types in MODEL_TYPES.values() for t in types}
    for auto_cls in auto_classes().values():
        extra = auto_cls._model_mapping._extra_content
        for config_cls in configs:
            value = extra.get(config_cls)
            if getattr(value, "__module__", "").startswith("patchgen.generated.") or (
                isinstance(value, type) and issubclass(value, CompositeConfigLoader)
            ):
                del extra[config_cls]
