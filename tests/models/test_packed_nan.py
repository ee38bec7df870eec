"""A NaN in one packed sequence does not reach the other sequences of the row (issue 14, item 3)."""

import pytest
import torch

from tests.models import tiny


@pytest.mark.parametrize("model,device", sorted(tiny.MODULES))
def test_nan_in_one_sequence_leaves_the_others_equal_to_running_alone(model, device):
    net = tiny.build(model, device)
    lengths = [9, 7]
    ids, cu = tiny.packed_batch(lengths, seed=5)
    embeds = net.get_input_embeddings()(ids).detach().clone()
    embeds[:, 8] = float("nan")  # the last token of the first sequence
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = net(inputs_embeds=embeds, position_ids=positions, **tiny.packed_kwargs(cu)).logits
        alone = net(input_ids=ids[:, 9:]).logits
    assert torch.isfinite(packed[:, 9:]).all()
    torch.testing.assert_close(packed[:, 9:], alone, rtol=0, atol=1e-10)
