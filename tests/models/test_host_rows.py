"""A packed row handed over on the host (`kernels/modeling/host_rows.py`): uploaded once, and every check and the
plan read the host copy, never a copy back from the device.

Off CUDA nothing is uploaded, so the device copies here are stand-ins that differ from the host copies: a check or
a plan that read them instead would fail or differ. The upload itself, and that no sync comes before the LM head,
run on the GPU (`test_host_rows_gpu.py`).
"""

from types import SimpleNamespace

import pytest
import torch
from patchgen.kernels import ops
from patchgen.kernels.modeling import host_rows, shared_prefix
from patchgen.kernels.modeling.boundaries import PackedMetadataError, resolve_packed
from patchgen.kernels.modeling.packing import PACKED_ROW
from patchgen.kernels.shared_prefix import positions_from_cu_seqlens

from tests.models import tiny
from tests.shared_prefix.plan_differences import differences

GROUPS = [(80, [10, 20, 15]), (70, [5, 1])]


def _row():
    ids, cu, _ = tiny.grpo_batch(GROUPS, [30], seed=3)
    return ids, cu.to(torch.int32)


def test_boundaries_of_an_uploaded_row_are_checked_on_its_host_copy():
    ids, cu = _row()
    garbage = torch.tensor([0, 9, 3, ids.shape[1]], dtype=torch.int32)  # what a read of the device copy would see
    uploaded = host_rows.HostRow(ids, None, cu)
    kwargs = resolve_packed({"cu_seq_lens_q": garbage, "cu_seq_lens_k": garbage}, None, ids, uploaded=uploaded)
    assert torch.equal(kwargs[PACKED_ROW].cu_seqlens_cpu, cu)
    with pytest.raises(PackedMetadataError, match="does not describe a packed row"):
        resolve_packed({"cu_seq_lens_q": garbage, "cu_seq_lens_k": garbage}, None, ids)


def test_positions_of_an_uploaded_row_are_checked_on_its_host_copy():
    ids, cu = _row()
    right = positions_from_cu_seqlens(cu, ids.shape[1])
    wrong = torch.arange(ids.shape[1]).unsqueeze(0)  # never restarts
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    with pytest.raises(PackedMetadataError, match="disagree with the packed row's boundaries"):
        resolve_packed(kwargs, right, ids, uploaded=host_rows.HostRow(ids, wrong, cu))
    resolve_packed(kwargs, wrong, ids, uploaded=host_rows.HostRow(ids, right, cu))  # the device copy is not read


def test_seq_idx_of_an_uploaded_row_is_checked_on_its_host_copy(monkeypatch):
    """`seq_idx` beside `cu_seq_lens_q` is checked against the boundaries: on an uploaded row, on its host copy
    (the upload keeps it), not with a read back of the device copy, which would sync before the forward."""
    ids, cu = _row()
    seq_idx = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff().long()).unsqueeze(0).int()
    garbage = torch.zeros_like(seq_idx)  # what a read of the device copy would see: one sequence
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "seq_idx": garbage}
    row = host_rows.HostRow(ids, None, cu, seq_idx=seq_idx)
    assert resolve_packed(kwargs, None, ids, uploaded=row)[PACKED_ROW] is not None
    with pytest.raises(PackedMetadataError, match="seq_idx marks the sequences"):
        resolve_packed(kwargs, None, ids)  # control: the device copy does disagree
    with pytest.raises(PackedMetadataError, match="seq_idx marks the sequences"):
        resolve_packed({**kwargs, "seq_idx": seq_idx}, None, ids, uploaded=host_rows.HostRow(ids, None, cu, seq_idx=garbage))
    monkeypatch.setattr(host_rows, "queue_upload", _Recorded())
    *_, out_kwargs, host = host_rows.upload(_on("cuda"), ids, None, None, None, {"cu_seq_lens_q": cu, "seq_idx": seq_idx})
    assert host.seq_idx is seq_idx and out_kwargs["seq_idx"] is not seq_idx


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_the_plan_of_an_uploaded_row_is_built_from_its_host_copy(model):
    ids, cu = _row()
    net = tiny.build(model, "gpu", seed=0, shared_prefix_training=True)
    net.config.shared_prefix_plan_reuse = False
    positions = positions_from_cu_seqlens(cu, ids.shape[1])

    def plan(device_ids, device_positions, uploaded):
        kwargs = resolve_packed({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, device_positions, device_ids, uploaded=uploaded)
        return shared_prefix.plan_for(
            net.config, ops.of(net), input_ids=device_ids, position_ids=device_positions, cache=None,
            use_cache=False, kwargs=kwargs, uploaded=uploaded,
        )

    direct = plan(ids, positions, None)
    # device copies that would share everything differently: zero ids, positions that never restart
    blank, counting = torch.zeros_like(ids), torch.arange(ids.shape[1]).unsqueeze(0)
    from_host = plan(blank, counting, host_rows.HostRow(ids, positions, cu))
    assert direct is not None and differences(from_host, direct) == []
    assert differences(plan(blank, positions, None), direct) != []  # control: the device copy does matter


class _Recorded:
    """Stands in for the copy to a device (there is none here): tags each copy, counts them."""

    def __init__(self):
        self.copies = []

    def __call__(self, tensor, device):
        copy = tensor.clone()
        self.copies.append(tensor)
        return copy


def _on(device: str):
    return SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(weight=SimpleNamespace(device=torch.device(device))))


def test_a_host_row_for_a_gpu_model_is_uploaded_once_and_its_positions_left_to_the_forward(monkeypatch):
    ids, cu = _row()
    labels = ids.clone()
    recorded = _Recorded()
    monkeypatch.setattr(host_rows, "queue_upload", recorded)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "shift_labels": labels, "max_length_q": 80, "return_log_probs": True}
    out_ids, out_pos, mask, out_labels, out_kwargs, host = host_rows.upload(_on("cuda"), ids, None, None, labels, kwargs)
    assert host.input_ids is ids and host.cu_seq_lens_q is cu and host.shift_labels is labels
    # one copy per host tensor: cu_seq_lens_k stays the very tensor cu_seq_lens_q is (the checks read identity)
    assert [id(t) for t in recorded.copies] == [id(cu), id(labels), id(ids)]
    assert out_kwargs["cu_seq_lens_k"] is out_kwargs["cu_seq_lens_q"] and out_kwargs["cu_seq_lens_q"] is not cu
    assert out_labels is out_kwargs["shift_labels"] and mask is None
    assert out_kwargs["max_length_q"] == 80 and out_kwargs["return_log_probs"] is True
    assert torch.equal(out_ids, ids) and out_ids is not ids
    # no positions made up here: the forward derives them from the boundaries (or M-RoPE's for a media row),
    # and the plan derives the same on the host
    assert out_pos is None and host.position_ids is None
    assert torch.equal(host.positions(None), positions_from_cu_seqlens(cu, ids.shape[1]))


def test_the_plan_reads_the_callers_own_positions_wherever_they_came(monkeypatch):
    ids, cu = _row()
    monkeypatch.setattr(host_rows, "queue_upload", _Recorded())
    theirs = positions_from_cu_seqlens(cu, ids.shape[1]) * 2  # any positions the caller chose
    *_, host = host_rows.upload(_on("cuda"), ids, theirs, None, None, {"cu_seq_lens_q": cu})
    assert host.position_ids is theirs and host.positions(None) is theirs  # given on the host: that copy
    on_device = theirs.clone()  # stands in for the caller's positions given on the device
    host = host_rows.HostRow(ids, None, cu, positions_from_boundaries=False)
    assert host.positions(on_device) is on_device  # read back, never replaced by ones derived from the boundaries


def test_labels_on_the_host_are_not_counted_when_shift_labels_came_on_the_device(monkeypatch):
    """The head reads shift_labels first wherever they are: host labels would count other rows."""
    ids, cu = _row()
    monkeypatch.setattr(host_rows, "queue_upload", _Recorded())
    on_device = ids.clone()
    monkeypatch.setattr(host_rows, "_on_host", lambda value: isinstance(value, torch.Tensor) and value is not on_device)
    *_, host = host_rows.upload(_on("cuda"), ids, None, None, ids.clone(), {"cu_seq_lens_q": cu, "shift_labels": on_device})
    assert host.labels is None and host.shift_labels is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_nothing_is_uploaded_for_a_model_on_the_host(device, monkeypatch):
    ids, cu = _row()
    monkeypatch.setattr(host_rows, "queue_upload", pytest.fail)
    kwargs = {"cu_seq_lens_q": cu}
    out = host_rows.upload(_on(device), ids, None, None, None, kwargs)
    assert out[0] is ids and out[4] is kwargs and out[5] is None
