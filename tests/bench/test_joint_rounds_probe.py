"""`bench/joint_rounds_probe.py` runs fla's stage kernels, which need the GPU: off it, it says so."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import joint_rounds_probe


def test_the_joint_rounds_probe_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        joint_rounds_probe.main([])
