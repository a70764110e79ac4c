"""The token dataset the torchtitan jobs train on (tests/torchtitan_job.py, the GPU check): no framework imports."""

from __future__ import annotations

from typing import Any

import torch


class TokenSamples(torch.utils.data.Dataset):
    """Sample ``i``: ``seq`` + 1 tokens below ``vocab`` drawn from a generator seeded with ``1000 + i``, plus ``i``
    itself (so a test can tell exactly which samples a resumed loader yields)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[dict[str, Any], torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input": tokens[:-1], "sample": i}, tokens[1:]
