"""Section 4 guards provided to the model code: capability checks and refused features."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from patchgen.kernels import capabilities as caps
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.shared_prefix import (
    BitIdentityNotGuaranteed,
    PackedMetadataMissing,
    check_attention_backend,
    check_conv_backend,
    check_gdn_backend,
    positions_from_cu_seqlens,
    reject_unsupported,
    require_packed_metadata,
    takes_ordinary_path,
    warn_row_count_dependent,
)

FLA = SimpleNamespace(
    name="fla",
    capabilities=frozenset({caps.VARLEN, caps.INITIAL_STATE, caps.INITIAL_STATE_GRAD, caps.FINAL_STATE_GRAD}),
)
NO_DH0 = SimpleNamespace(name="nodh0", capabilities=frozenset({caps.VARLEN, caps.INITIAL_STATE}))
FLASH = SimpleNamespace(
    name="flash", capabilities=frozenset({caps.VARLEN, caps.BOTTOM_RIGHT_CAUSAL, caps.GQA})
)
SDPA = SimpleNamespace(name="sdpa", capabilities=frozenset({caps.GQA}))


def test_gdn_backend_without_initial_state_gradient_names_the_working_ones():
    check_gdn_backend(FLA)
    with pytest.raises(BackendUnavailable) as err:
        check_gdn_backend(NO_DH0, working=[FLA, NO_DH0, "torch"])
    assert err.value.slot == "gated_delta_rule" and err.value.backend == "nodh0"
    assert err.value.working == ("fla", "torch")
    assert caps.INITIAL_STATE_GRAD in str(err.value) and "fla, torch" in str(err.value)


def test_attention_backend_without_varlen_bottom_right_is_refused():
    check_attention_backend(FLASH)
    with pytest.raises(BackendUnavailable, match="bottom_right_causal.*flash"):
        check_attention_backend(SDPA, working=[SDPA, FLASH])


def test_conv_backend_must_be_varlen():
    check_conv_backend(FLA)
    with pytest.raises(BackendUnavailable, match="varlen"):
        check_conv_backend(SDPA, working=["fla"])


def test_missing_packed_metadata_is_a_clear_error():
    require_packed_metadata(torch.tensor([0, 3]))
    with pytest.raises(PackedMetadataMissing, match="packed metadata.*cu_seq_lens_q"):
        require_packed_metadata(None)


@pytest.mark.parametrize(
    "kwargs", [{"cache": object()}, {"use_cache": True}, {"mtp": True}, {"sequence_parallel": True}]
)
def test_unsupported_features_raise_not_implemented(kwargs):
    with pytest.raises(NotImplementedError):
        reject_unsupported(**kwargs)
    reject_unsupported()


def test_ordinary_path_conditions():
    ids = torch.zeros(1, 3)
    assert not takes_ordinary_path(True, ids)
    assert takes_ordinary_path(False, ids)
    assert takes_ordinary_path(True, None)
    assert takes_ordinary_path(True, ids, pixel_values=torch.zeros(1))
    assert takes_ordinary_path(True, ids, pixel_values_videos=torch.zeros(1))
    # images given as the vision tower's outputs, computed beforehand: media too
    encoded = {"image": object()}
    assert takes_ordinary_path(True, ids, mm_encoder_outputs=encoded)
    assert not takes_ordinary_path(True, ids, mm_encoder_outputs={"image": None, "video": None})


def test_positions_from_cu_seqlens_restart_per_sequence():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu, 9).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_a_gated_norm_without_row_invariance_warns_once_that_bits_may_differ(monkeypatch):
    from patchgen.kernels import registry
    from patchgen.kernels.shared_prefix import guards

    monkeypatch.setattr(guards, "_WARNED", set())
    fla, ours = registry.handle("rms_norm_gated", "fla"), registry.handle("rms_norm_gated", "triton")
    with pytest.warns(BitIdentityNotGuaranteed, match="rms_norm_gated='triton'"):
        warn_row_count_dependent("rms_norm_gated", fla)  # tuned per bucket of row count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_row_count_dependent("rms_norm_gated", fla)  # once per process
        warn_row_count_dependent("rms_norm_gated", ours)  # one launch shape for every row count: silent
        warn_row_count_dependent("rms_norm_gated", registry.handle("rms_norm_gated", "torch"))
