"""Rows with images: M-RoPE positions as upstream gives them, and images given as pixels or as encoder outputs."""

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

from tests.models import tiny

IMAGE, VISION_START, VISION_END = 150, 151, 152
GRID = torch.tensor([[1, 4, 4]])  # 16 patches, 4 image tokens after the 2 x 2 merge
PATCH_WIDTH = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def _vl_model(model, device="gpu"):
    text = tiny.text_config(model).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    config_class = Qwen3_5Config if model == "qwen3_5" else Qwen3_5MoeConfig
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=IMAGE,
                          vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    net = getattr(tiny.module(model, device), tiny.PREFIX[model] + "ForConditionalGeneration")(config).double()
    return tiny.randomize(net).eval()


def _rollouts_of_one_prompt(images: int):
    """Three rollouts of one prompt holding an image (the same placeholder ids whatever the image), packed."""
    gen = torch.Generator().manual_seed(9)
    prompt = torch.cat([torch.randint(0, 140, (70,), generator=gen), torch.tensor([VISION_START, *[IMAGE] * 4, VISION_END])])
    seqs = [torch.cat([prompt, torch.randint(0, 140, (n,), generator=gen)]) for n in (7, 12, 4)]
    ids = torch.cat(seqs).unsqueeze(0)
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    pixels = torch.randn(images * 16, PATCH_WIDTH, generator=gen, dtype=torch.float64)
    pixels = pixels if images == 3 else pixels.repeat(3, 1)
    return dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=GRID.repeat(3, 1),
                **tiny.packed_kwargs(cu)), pixels


@pytest.mark.parametrize("images", [1, 3])  # one image in every rollout, or a different one in each
@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_images_given_as_encoder_outputs_score_as_the_same_images_given_as_pixels(model, images, flag):
    """Before, precomputed `mm_encoder_outputs` were not seen as media: the packed row's positions replaced upstream's
    M-RoPE ones, and the flag shared rows of different images because their placeholder ids agree."""
    net = _vl_model(model)
    net.config.text_config.shared_prefix_training = flag
    batch, pixels = _rollouts_of_one_prompt(images)
    with torch.no_grad():
        from_pixels = net(pixel_values=pixels, **batch).logits
        encoded = net.model.get_image_features(pixels, batch["image_grid_thw"], return_dict=True)
        from_encoder = net(mm_encoder_outputs={"image": encoded}, **batch).logits
    assert torch.allclose(from_encoder, from_pixels, atol=1e-12, rtol=0)


@pytest.mark.parametrize("device", ["gpu", "npu"])
def test_an_image_opening_a_sequence_keeps_it_one_sequence_as_upstream(device, monkeypatch):
    """M-RoPE's temporal row stays at 0 over an image that opens a sequence (upstream's get_rope_index); such 3-row
    positions are one sequence, as upstream runs them, not a packed row split at every 0 (before: split)."""
    net = tiny.build("qwen3_5", device)
    upstream = tiny.upstream_model("qwen3_5", monkeypatch, net.state_dict())
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    image = torch.stack([torch.zeros(16, dtype=torch.long), rows.flatten(), cols.flatten()])
    text = (torch.arange(14) + 4).expand(3, -1)
    positions = torch.cat([image, text], 1).unsqueeze(1)  # [3, 1, 30]
    ids = torch.randint(0, tiny.VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    expected = upstream(input_ids=ids, position_ids=positions).logits
    assert torch.allclose(net(input_ids=ids, position_ids=positions).logits, expected, atol=1e-10, rtol=0)
