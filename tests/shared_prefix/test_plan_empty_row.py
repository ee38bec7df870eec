"""An empty packed row is no plan, with or without position_ids (a mutation gap of issue 14)."""

import pytest
import torch
from patchgen.kernels.shared_prefix import build_plan

EMPTY_IDS = torch.zeros(1, 0, dtype=torch.long)


@pytest.mark.parametrize("cu", [[0], [0, 0], [0, 0, 0]])
@pytest.mark.parametrize("positions", [None, torch.zeros(1, 0, dtype=torch.long), torch.zeros(3, 1, 0, dtype=torch.long)])
def test_empty_row_gives_no_plan(cu, positions):
    assert build_plan(EMPTY_IDS, torch.tensor(cu, dtype=torch.int32), positions, min_prefix=1) is None
