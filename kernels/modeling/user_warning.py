"""Warnings reported where the user's code called the model, not inside transformers' wrappers or ours.

A model forward reaches our code through transformers' decorators (output capturing, deprecation shims), whose
depth changes with the model class and the transformers version: a fixed `stacklevel` lands in one of them, and
Python's default filter then shows the warning once for that wrapper line, whoever called.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch
import transformers

_INSIDE = tuple(
    folder + os.sep
    for package in ("patchgen.kernels", "patchgen.generated")  # the generated modeling code calls our kernels
    for folder in importlib.util.find_spec(package).submodule_search_locations
) + tuple(os.path.dirname(module.__file__) + os.sep for module in (transformers, torch))


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """`warnings.warn` at the first frame outside patchgen's kernels and generated modules, transformers and torch."""
    frame, level = sys._getframe(1), 2  # stacklevel 1 is this function, 2 its caller
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
