"""Tiny checkpoints saved by upstream's own classes, and what upstream makes of loading them."""

from __future__ import annotations

import importlib

import torch

from tests.models import tiny

LAYOUTS = ("ForCausalLM", "ForConditionalGeneration")  # the upstream class that saved the checkpoint
# The classes each layout loads into upstream (a text-only checkpoint has no vision tower to build).
DESTINATIONS = {
    "ForCausalLM": ("ForCausalLM", "TextModel"),
    "ForConditionalGeneration": ("ForCausalLM", "ForConditionalGeneration", "Model", "TextModel"),
}


def vl_config(model: str):
    """A tiny vision-language config (the layout Qwen3.5 is published in) around tiny.text_config."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    text = tiny.text_config(model).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    cls = Qwen3_5Config if model == "qwen3_5" else Qwen3_5MoeConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=False)


def config_for(model: str, layout: str):
    return tiny.text_config(model) if layout == "ForCausalLM" else vl_config(model)


def upstream_class(model: str, name: str):
    return getattr(importlib.import_module(tiny.UPSTREAM[model]), tiny.PREFIX[model] + name)


def generated_class(model: str, device: str, name: str):
    return getattr(tiny.module(model, device), tiny.PREFIX[model] + name)


def save_upstream(model: str, layout: str, path, seed: int = 0):
    """Build upstream's class of ``layout`` (seeded init, then random norms and routers) and save it."""
    torch.manual_seed(seed)
    net = upstream_class(model, layout)(config_for(model, layout))
    tiny.randomize(net, seed)
    net.save_pretrained(path)
    return net


def load(cls, path, **kwargs):
    """``cls.from_pretrained`` in float32 with its loading report as plain sorted lists."""
    net, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    return net.eval(), {key: sorted(map(str, value)) for key, value in info.items()}


def ids(seed: int = 0, length: int = 12):
    return torch.randint(0, tiny.VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
