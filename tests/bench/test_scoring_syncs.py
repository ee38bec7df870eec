"""`bench/scoring_syncs.py` off CUDA: its batch is one GRPO group with the prompts masked, and it refuses to run
without the CUDA sync debug mode it counts with."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scoring_syncs


def test_the_group_is_one_prompt_and_its_responses_with_the_prompts_masked():
    ids, cu, labels = scoring_syncs.group()
    lengths = [scoring_syncs.PROMPT + r for r in scoring_syncs.RESPONSES]
    assert cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()] and ids.shape == (1, sum(lengths))
    starts = cu[:-1].tolist()
    assert all(torch.equal(ids[0, s : s + scoring_syncs.PROMPT], ids[0, : scoring_syncs.PROMPT]) for s in starts)
    assert int((labels == -100).sum()) == scoring_syncs.PROMPT * len(starts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
def test_without_cuda_it_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        scoring_syncs.main([])
