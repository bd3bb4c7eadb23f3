"""The benchmarks' held-out losses against torch's own cross entropy and KL divergence, and the
distil-alone baseline lowering its KD loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.elastic.measure import distil_alone, heldout_losses
from tests.unit.test_elastic_slicing import world  # noqa: F401

VOCAB, PADDED = 10, 12


class Bigram(nn.Module):
    """Logits from the current token alone, in megatron's (tokens, positions, mask) call form."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(PADDED, PADDED, generator=torch.Generator().manual_seed(seed)))

    def forward(self, tokens, positions, mask):
        return self.table[tokens]


def batches(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (2, 9), generator=g)
        mask = (torch.rand(2, 8, generator=g) > 0.3).float()
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask, "position_ids": torch.arange(8)[None]})
    return out


def test_heldout_losses_match_torch(world):  # noqa: F811
    student, teacher, held = Bigram(0), Bigram(1), batches(3)
    ce, kd = heldout_losses(student, held, [teacher(b["tokens"], None, None) for b in held], VOCAB)
    ce_ref = kd_ref = count = 0.0
    for b in held:
        s = student(b["tokens"], None, None)[..., :VOCAB].log_softmax(-1)
        t = teacher(b["tokens"], None, None)[..., :VOCAB].log_softmax(-1)
        m = b["loss_mask"]
        ce_ref += float((F.nll_loss(s.flatten(0, 1), b["labels"].flatten(), reduction="none") * m.flatten()).sum())
        kd_ref += float((F.kl_div(s, t, log_target=True, reduction="none").sum(-1) * m).sum())
        count += float(m.sum())
    assert abs(ce - ce_ref / count) < 1e-5 and abs(kd - kd_ref / count) < 1e-5


def test_distil_alone_lowers_the_kd_loss(world):  # noqa: F811
    student, teacher, train = Bigram(0), Bigram(1), batches(4)
    teacher.requires_grad_(False)
    losses = distil_alone(student, teacher, lambda step: train[step % 2 :: 2], steps=30, lr=0.05, vocab=VOCAB)
    assert losses[-1] < 0.5 * losses[0], losses
