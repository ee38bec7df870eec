"""A LoRA layer written to PEFT's documented tuner-layer semantics (PEFT is not a dependency here): the
base layer plus a scaled low-rank delta while adapters are enabled, `_disable_adapters` and
`_active_adapter` read on the host by the forward, and `.weight` giving the base layer's weight (as
PEFT's `BaseTunerLayer.weight` does): what a fused op reading `.weight` would see."""

import torch


class LoraLikeLinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int = 2, seed: int = 5):
        super().__init__()
        self.base_layer = base
        gen = torch.Generator().manual_seed(seed)
        dtype = base.weight.dtype
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, dtype=dtype)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, dtype=dtype)
        with torch.no_grad():  # PEFT starts B at zero; nonzero here so that a skipped delta shows
            self.lora_A.weight.copy_(torch.randn(self.lora_A.weight.shape, generator=gen, dtype=dtype))
            self.lora_B.weight.copy_(torch.randn(self.lora_B.weight.shape, generator=gen, dtype=dtype))
        self._disable_adapters = False
        self._active_adapter = "default"
        self.merged_adapters = []
        self.scaling = {"default": 0.5}

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        out = self.base_layer(x)
        if self._disable_adapters:
            return out
        return out + self.lora_B(self.lora_A(x)) * self.scaling[self._active_adapter]


def wrap(parent: torch.nn.Module, name: str, seed: int = 5) -> LoraLikeLinear:
    wrapped = LoraLikeLinear(getattr(parent, name), seed=seed)
    setattr(parent, name, wrapped)
    return wrapped
