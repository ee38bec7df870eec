"""A pytest plugin that runs transformers' own Qwen3.5 model tests against the generated modules.

Loaded with ``-p patchgen.integrations.upstream_tests`` and ``PATCHGEN_SWAP_DEVICE=gpu|npu``, it puts
the generated module of that device in ``sys.modules`` under upstream's module name
(``transformers.models.qwen3_5.modeling_qwen3_5`` and the MoE one) before any test module is
imported, so ``from transformers import Qwen3_5ForCausalLM`` and the auto classes give the generated
classes. After collection it checks that every test module really holds the generated classes and
stops the run otherwise: a run that silently tested upstream would report upstream's results as ours.
``bench/upstream_model_tests.py`` drives it; docs/loading.md.
"""

from __future__ import annotations

import os
import sys

import pytest

from patchgen.integrations.auto import MODELS, generated_module

SWAP_ENV = "PATCHGEN_SWAP_DEVICE"


class SwapNotInEffect(RuntimeError):
    """A test module holds upstream's class where the swap should have put the generated one."""


def upstream_module_name(model: str) -> str:
    return f"transformers.models.{model}.modeling_{model}"


def swap_in(device: str) -> dict[str, object]:
    """Make upstream's modeling module names resolve to the generated modules of ``device``."""
    import importlib

    import transformers

    from patchgen import register

    swapped = {}
    for model in MODELS:
        ours = generated_module(model, device)
        name = upstream_module_name(model)
        sys.modules[name] = ours
        package = importlib.import_module(f"transformers.models.{model}")
        # The lazy packages cache attributes once resolved: set ours explicitly.
        setattr(package, f"modeling_{model}", ours)
        for class_name in getattr(ours, "__all__", ()):
            setattr(package, class_name, getattr(ours, class_name))
            setattr(transformers, class_name, getattr(ours, class_name))
        swapped[name] = ours
    register(device)
    return swapped


def pytest_configure(config):
    device = os.environ.get(SWAP_ENV)
    if not device:
        raise pytest.UsageError(
            f"patchgen.integrations.upstream_tests was loaded but {SWAP_ENV} is not set; "
            f"set it to 'gpu' or 'npu' (or do not load the plugin to run upstream's modules)"
        )
    config._patchgen_swapped = swap_in(device)


def pytest_report_header(config):
    swapped = getattr(config, "_patchgen_swapped", {})
    return [f"patchgen swap: {name} -> {module.__name__}" for name, module in swapped.items()]


def pytest_collection_finish(session):
    swapped = getattr(session.config, "_patchgen_swapped", {})
    ours = {}
    for module in swapped.values():
        for class_name in getattr(module, "__all__", ()):
            ours[class_name] = getattr(module, class_name)
    checked = 0
    for item in session.items:
        test_module = getattr(item, "module", None)
        if test_module is None:
            continue
        for class_name, cls in ours.items():
            held = getattr(test_module, class_name, None)
            if held is None:
                continue
            checked += 1
            if held is not cls:
                raise SwapNotInEffect(
                    f"{test_module.__name__}.{class_name} is {held.__module__}.{held.__qualname__}, "
                    f"expected the generated {cls.__module__}.{class_name}"
                )
    if session.items and not checked:
        raise SwapNotInEffect(
            "no collected test module imports a Qwen3.5 class; nothing would test the generated modules"
        )
