"""patchgen: generates readable, patched HuggingFace modeling modules.

Kept import-light on purpose: `import patchgen.kernels` (run time) must not pay for the
generator (libcst, jinja2), and nothing here imports torch.
"""

__version__ = "0.1.0"


def register(device: str = "gpu") -> dict[str, dict[str, str]]:
    """Make transformers' auto classes (``AutoModelForCausalLM`` ...) build the generated Qwen3.5 and
    Qwen3.5-MoE classes of ``device`` ("gpu" or "npu"); see ``patchgen.integrations.auto`` and docs/loading.md."""
    from patchgen.integrations.auto import register as _register

    return _register(device)
