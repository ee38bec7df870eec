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


class CudaGraphsUnavailable(RuntimeError):
    """``shared_prefix_cuda_graphs`` is on where the layer stack cannot run under CUDA graphs (no CUDA device,
    activation checkpointing, per-layer outputs asked for, an argument a graph cannot hold). The message
    names what was found and the fix."""


class GraphCaptureFailed(RuntimeError):
    """Capturing the decoder-layer stack failed: something inside it synchronises with the host or reads
    host data per call. The message names the op and the way out (turn the graphs off)."""


class GraphReplayOverwritten(RuntimeError):
    """The backward of a graphed forward ran after a later forward replayed the same graph, which overwrote
    the activations that backward reads: its gradients would be another batch's."""


class WrappedModuleUnsupported(RuntimeError):
    """A module a fused kernel reads the weight of (and never calls) is wrapped, subclassed or hooked:
    the wrapper's computation would be skipped. The message names the module and the fix."""


class ExpertWeightsUnloadable(RuntimeError):
    """``load_state_dict`` got per-expert tensors (a checkpoint's layout) it cannot turn into a fused experts
    parameter: the experts would keep their old weights. The message names the parameter, why, and the fix."""

    def __init__(self, fused_key: str, reason: str):
        self.fused_key, self.reason = fused_key, reason
        super().__init__(
            f"load_state_dict: cannot load the checkpoint's per-expert tensors into '{fused_key}': {reason}. "
            "Load a checkpoint saved for this model's config (per-expert keys as save_pretrained writes them, or the "
            "fused keys of model.state_dict(), not both), or build the model with from_pretrained(checkpoint)."
        )
