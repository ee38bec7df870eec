"""Error types of the run-time kernel layer."""


class BackendUnavailable(RuntimeError):
    """A requested backend cannot serve an op slot: not installed, wrong version, or lacking a capability.

    The message names the slot, the backend, the reason and the backends that would work.
    """

    def __init__(self, slot: str, backend: str, reason: str, working: list[str] | tuple[str, ...] = ()):
        self.slot, self.backend, self.reason, self.working = slot, backend, reason, tuple(working)
        alternatives = ", ".join(self.working) if self.working else "none available here"
        super().__init__(
            f"op slot '{slot}': backend '{backend}' cannot be used: {reason}. Backends that would work: {alternatives}."
        )


class SettingError(ValueError):
    """A patchgen setting (a model config field or an environment variable) that names nothing or holds
    a bad value. The message names the setting as the user wrote it, what was found and the fix."""


class MissingWeights(RuntimeError):
    """``from_pretrained`` found no tensor for weights the model needs: transformers would leave them
    randomly initialised. The message names them and the fix."""

    def __init__(self, cls_name: str, source: str, missing: list[str]):
        self.missing = tuple(missing)
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        super().__init__(
            f"{cls_name}.from_pretrained({source}): {len(missing)} weight(s) are not in the checkpoint and would be "
            f"randomly initialised: {shown}. Load a checkpoint saved for this model's config (the published "
            "ForConditionalGeneration layout or a ForCausalLM checkpoint of the same config), or pass "
            "allow_missing_weights=True to keep them random, as transformers does (it reports them as MISSING)."
        )
