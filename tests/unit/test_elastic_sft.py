"""Elastic distillation on SFT conversations: a packed micro-batch distils every conversation as
that conversation alone, at budgets below the full model, for both `distill_tokens` choices.

Against the same conversations one per sample (pack=False: no attention mask, nothing to keep
apart), through the Distiller: the same loss sum, token count and gradients (student and
router). Against torch's own `kl_div` / `cross_entropy` on each conversation run alone, for a
micro-batch whose samples drew different budgets (the student runs per budget group, each with its
rows of the attention mask): the same per-token losses. The KD tokens are counted from the
conversations' lengths and assistant turns. The model and the router are fp64."""

from __future__ import annotations

import numpy
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config import compose_config
from megatron_ext.config.validate import ConfigError, validate_run
from megatron_ext.data.datasets import _collate
from megatron_ext.data.sft.dataset import SFTDataset
from megatron_ext.elastic.distill import CurriculumConfig, Distiller, distilled_tokens
from megatron_ext.elastic.router import BudgetRouter, RouterConfig, apply_choice
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_per_sample import grads
from tests.unit.test_elastic_router import BUDGETS, GRID
from tests.unit.test_elastic_slicing import PARENT, build_parent, world  # noqa: F401
from tests.unit.test_sft_packing_loss import _conversations

VOCAB, TEMPERATURE, CE = 100, 2.0, 0.5
# 33 tokens fill a sample (its last label is the conversation's own), 32 leave one padding token.
LENGTHS = [11, 17, 9, 33, 6, 14, 32, 5, 20]
CONVERSATIONS = _conversations(LENGTHS, VOCAB)  # the second half of each answers
STEP = 30  # the router still anneals: its choice passes a gradient
# Seeds of the draws (asserted below, so that a change of the draw cannot make a check vacuous):
# budget_draw="micro_batch", seed 1 draws budget 2 (0.5) for the step's first micro-batch;
# budget_draw="sample", seed 6 draws two budgets below the full model among the packed samples.
MICRO_BATCH_SEED, SAMPLE_SEED = 1, 6


def distiller(space: ElasticSpace, teacher, distill_tokens: str, budget_draw: str, seed: int) -> Distiller:
    router = BudgetRouter(BUDGETS, GRID, RouterConfig(anneal_steps=100), seed=0).double()
    cfg = CurriculumConfig(
        BUDGETS, temperature=TEMPERATURE, ce_weight=CE, seed=seed, budget_draw=budget_draw, distill_tokens=distill_tokens
    )
    d = Distiller(space, teacher, router, cfg, VOCAB)
    d.warm_up_router(20)  # the budgets' sizes differ (a fresh router picks at random)
    router.zero_grad()  # the router's gradient is the distillation loss's alone
    return d


def micro_batch(pack: bool) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Every conversation in one micro-batch, packed or one per sample, and each sample's
    conversations in order."""
    dataset = SFTDataset(CONVERSATIONS, list(range(len(LENGTHS))), PARENT.seq_length, 1, seed=0, pack=pack, pad=0)
    return _collate([dataset[i] for i in range(len(dataset))]), dataset.samples


def expected_tokens(distill_tokens: str) -> int:
    """Every label of a conversation's own (all), or its assistant tokens (loss_mask)."""
    if distill_tokens == "all":
        return sum(n - 1 for n in LENGTHS)
    return sum(int(CONVERSATIONS.piece(i)[1][1:].sum()) for i in range(len(LENGTHS)))


@pytest.fixture(scope="module")
def models(world):  # noqa: F811
    student, teacher = build_parent().double(), build_parent().double().eval().requires_grad_(False)
    return student, teacher, ElasticSpace(student)


def distil(student, teacher, space: ElasticSpace, distill_tokens: str, pack: bool) -> dict:
    """One micro-batch of every conversation (budget_draw="micro_batch"), through the Distiller
    and megatron's loss reduction; its backward of the per-token mean."""
    batch, samples = micro_batch(pack)
    # packed: conversations share samples, each attending to itself
    assert ("document_ids" in batch) == pack == any(len(s) > 1 for s in samples), samples
    d = distiller(space, teacher, distill_tokens, "micro_batch", MICRO_BATCH_SEED)
    d.begin_step(STEP)
    per_token, reduce = d.forward_step(iter([batch]), student)
    loss_sum, tokens, _ = reduce(per_token)
    (loss_sum / tokens).backward()
    space.clear_gates()
    return {
        "loss": float((per_token.detach() * distilled_tokens(batch, distill_tokens)).sum()),  # megatron's sum is fp32
        "fp32_loss": float(loss_sum.detach()),
        "tokens": int(tokens),
        "router_tokens": d.loss_tokens,
        "budget": d.drawn[0][0],
        "sizes": d.micro_choice.sizes,
        "grads": grads(student, d.router),
    }


@pytest.mark.parametrize("distill_tokens", ["loss_mask", "all"])
def test_packed_micro_batch_distils_as_its_conversations_one_per_sample(models, distill_tokens):
    packed, alone = (distil(*models, distill_tokens, pack) for pack in (True, False))
    assert packed["budget"] == alone["budget"] == 2 and packed["sizes"] == alone["sizes"]
    assert packed["sizes"]["hidden"] < models[2].full()["hidden"], packed["sizes"]  # a budget below the full model
    assert expected_tokens("all") > 1.5 * expected_tokens("loss_mask")  # the prompts count too
    want = expected_tokens(distill_tokens)
    assert packed["tokens"] == alone["tokens"] == packed["router_tokens"] == alone["router_tokens"] == want
    # Megatron's RoPE turns a token by its place in the sample, not by its position id: a packed
    # conversation's attention scores are the same only up to the fp32 rounding of the angles.
    # Measured: the loss sums 3e-9 apart (megatron's fp32 sums 1e-7), the gradients 1.2e-6 of their
    # largest entry; a teacher or a student run without the mask puts the sums 1e-3 to 1.5e-2 apart.
    assert packed["loss"] == pytest.approx(alone["loss"], rel=1e-7)
    assert packed["fp32_loss"] == pytest.approx(alone["fp32_loss"], rel=1e-6)
    assert packed["fp32_loss"] == pytest.approx(packed["loss"], rel=1e-6)
    assert packed["grads"].keys() == alone["grads"].keys() and any(k.startswith("1.") for k in packed["grads"])
    for name, grad in alone["grads"].items():
        assert grad.abs().max() > 0, name
        assert float((packed["grads"][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name


def reference(student, teacher, conversation: int, distill_tokens: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token KD + CE on the assistant's tokens, the KD tokens) of `conversation` alone at
    the sizes applied, with torch's losses; [n - 1] each."""
    ids, assistant = (torch.from_numpy(numpy.asarray(x)) for x in CONVERSATIONS.piece(conversation))
    tokens, labels = ids[None, :-1], ids[1:]
    positions = torch.arange(len(ids) - 1)[None]
    s = student(tokens, positions, None)[0, :, :VOCAB]
    with torch.no_grad():
        t = teacher(tokens, positions, None)[0, :, :VOCAB]
    kd = F.kl_div(F.log_softmax(s / TEMPERATURE, -1), F.log_softmax(t / TEMPERATURE, -1), log_target=True, reduction="none")
    answer = assistant[1:].double()
    loss = kd.sum(-1) * TEMPERATURE**2 + CE * F.cross_entropy(s, labels, reduction="none") * answer
    return loss, torch.ones_like(answer) if distill_tokens == "all" else answer


@pytest.mark.parametrize("distill_tokens", ["loss_mask", "all"])
def test_mixed_budget_packed_micro_batch_equals_torchs_losses_of_each_conversation_alone(models, distill_tokens):
    student, teacher, space = models
    batch, samples = micro_batch(pack=True)
    d = distiller(space, teacher, distill_tokens, "sample", SAMPLE_SEED)
    d.begin_step(STEP)
    with torch.no_grad():
        per_token, reduce = d.forward_step(iter([batch]), student)
        _, tokens, _ = reduce(per_token)
    space.clear_gates()
    (budgets,) = d.drawn
    assert len(set(budgets)) > 1 and len(set(budgets) - {0}) >= 1, budgets  # several groups, one below full

    covered = torch.zeros_like(per_token)
    want = torch.zeros_like(per_token)
    with torch.no_grad():
        for row, (budget, conversations) in enumerate(zip(budgets, samples)):
            apply_choice(space, d.choice(budget))
            at = 0
            for c in conversations:
                n = LENGTHS[c] - 1
                want[row, at : at + n], covered[row, at : at + n] = reference(student, teacher, c, distill_tokens)
                at += LENGTHS[c]
            space.clear_gates()
    assert int(tokens) == int(covered.sum()) == expected_tokens(distill_tokens)
    # RoPE's fp32 angles (above): measured 2.2e-7 relative at worst.
    torch.testing.assert_close(per_token * covered, want * covered, rtol=2e-6, atol=1e-9)


def test_packed_sft_elastic_is_refused_where_conversations_cannot_be_kept_apart():
    sft = ["experiment=none", "plugin=elastic", "data=sft", "data.sft.path=[chat.jsonl]"]
    validate_run(compose_config(sft), 1, "cpu")  # a GPT parent: packed conversations attend to themselves
    with pytest.raises(ConfigError, match="Mamba layers carry state"):
        validate_run(compose_config([*sft, "model=hybrid_tiny"]), 1, "cpu")
    validate_run(compose_config([*sft, "model=hybrid_tiny", "data.sft.pack=false"]), 1, "cpu")

