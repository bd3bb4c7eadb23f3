"""Benchmark: nested elastic submodels from one distillation run vs pruning + distilling each
size separately, and think-small / answer-large generation.

    python scripts/bench/elastic.py --json OUT.json [--plot OUT.png]            # hybrid parent
    python scripts/bench/elastic.py --parent gpt --parent-steps 1000 --steps 200 --json OUT.json
    python scripts/bench/elastic.py --seeds 0 1 2 3 --budget-draw sample --json OUT.json     # 4 seeds
    python scripts/bench/elastic.py --parent smollm2_135m --json OUT.json --plot OUT.png   # real model and text
    python scripts/bench/elastic.py --seeds 0 1 2 --json A.json &  python scripts/bench/elastic.py \
        --seeds 3 4 5 --json B.json; wait; python scripts/bench/elastic.py --merge A.json B.json --json OUT.json

Parent (`--parent`): the tiny hybrid Mamba2 / attention / MoE / MLP model (megatron MambaModel,
pure-PyTorch Mamba2 mixer; default) or a tiny dense LLaMA-style GPT (megatron GPTModel), both
local spec, first trained briefly with next-token loss on a synthetic addition task with a
`<think>` scratchpad (digit-wise sums with carries, then the answer's digits, least significant
first), so the teacher is not random. The router is warmed up on the cost gap alone, then the
elastic run distils budgets 100/75/50 % of the parameters in `--steps` steps; the baseline prunes
the reordered parent to the same sizes and distils each size alone for the same number of steps
and tokens (N budgets: N times the elastic run's tokens). Both see the same batches and the same
learning rate, which falls linearly to zero over the steps (`--no-lr-decay`: constant; a constant
rate leaves both arms' final weights noisy enough to swamp the gap between them). Both arms are
repeated over `--seeds` (the parent is trained once, from `--seed`): seed k draws the elastic
run's budgets and router noise and both arms' batch order (seed 0: the batches of a single run).
Reported per budget: parameters (total, active), held-out next-token loss and KD loss to the
teacher (`--heldout-samples`, elastic and baseline: mean, standard error and per-seed values),
median forward latency of seed 0's exported model (one timing), tokens spent. The thinking curve
(seed 0): answer accuracy and answer loss vs wall time over thinking budgets, for think-50% /
answer-100%, 100% / 100% and 50% / 50%. With `--fp8`: the FP8 student's held-out KD and
next-token loss per budget, quantised after seed 0's elastic run (PTQ) against a second elastic
run with FP8 QAD.
`--budget-draw sample` draws a budget per sample instead of per micro-batch. The held-out losses of
one seed are one sample: their spread over seeds is as large as the gap between the arms, so
the targets are judged on the means and the gap is set against two combined standard errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from megatron_ext.elastic.measure import seed_stats
from megatron_ext.platform import cpu_compat
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

END_THINK, THINK, PLUS, EQUALS, SEP, EOS, PAD = 13, 12, 10, 11, 14, 15, 16
VOCAB, DIGITS = 17, 3
PROMPT_LEN = 2 * DIGITS + 2
SEQ = 32  # prompt 8 + think 2 + 6 per digit + answer 4 + EOS = 33 tokens


def example(a: int, b: int) -> tuple[list[int], list[int], list[int]]:
    """(prompt, thought, answer) token lists of a + b."""
    da, db = [int(c) for c in f"{a:0{DIGITS}d}"], [int(c) for c in f"{b:0{DIGITS}d}"]
    thought, carry = [THINK], 0
    for x, y in zip(reversed(da), reversed(db)):
        s = x + y + carry
        thought += [x, y, carry, s // 10, s % 10, SEP]
        carry = s // 10
    thought.append(END_THINK)
    # The sum's digits from the least significant on (the order the thought produced them in):
    # copied from a complete thought, computed in one go without it.
    answer = [int(c) for c in reversed(f"{a + b:0{DIGITS + 1}d}")] + [EOS]
    return da + [PLUS] + db + [EQUALS], thought, answer


def batch(seed: int, size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for a, b in torch.randint(0, 10**DIGITS, (size, 2), generator=g).tolist():
        p, t, ans = example(a, b)
        rows.append(p + t + ans)
    ids = torch.tensor(rows)
    mask = torch.ones(size, SEQ)
    mask[:, : PROMPT_LEN - 1] = 0  # the operands are random: only the thought and answer are learnable
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask, "position_ids": torch.arange(SEQ)[None].expand(size, -1)}


def train_batch(seed: int, step: int, size: int) -> dict:
    """Step `step`'s distillation batch of seed `seed`; seed 0 keeps the single run's batches and
    the offset keeps other seeds clear of the parent's (10_000+) and held-out (50_000+) seeds."""
    return batch(seed * 100_000 + step, size)


def heldout_set(samples: int) -> list[dict]:
    """`samples` held-out samples in batches of 64 (apart from the calibration batches)."""
    if samples % 64:
        raise ValueError(f"--heldout-samples must be a multiple of 64, got {samples}")
    return [batch(60_000 + i, 64) for i in range(samples // 64)]


def heldout(model, held: list[dict], teacher_logits: list[torch.Tensor]) -> tuple[float, float]:
    """(next-token CE, KD to the teacher) per loss-mask token of `model` on the held-out batches."""
    from megatron_ext.elastic.measure import heldout_losses

    return heldout_losses(model, held, teacher_logits, VOCAB)


def train_ce(model, steps: int, batch_size: int, lr: float) -> None:
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        b = batch(10_000 + step, batch_size)
        logits = model(b["tokens"], b["position_ids"], None)[..., :VOCAB]
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
        loss = (ce * b["loss_mask"].flatten()).sum() / b["loss_mask"].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def train_kd(model, teacher, steps: int, batch_size: int, lr: float, seed: int, decay: bool) -> None:
    """The baseline: one pruned model distilled alone (forward KL, same data, steps and learning
    rates as the elastic run)."""
    from megatron_ext.elastic.measure import distil_alone

    distil_alone(model, teacher, lambda step: [train_batch(seed, step, batch_size)], steps, lr, VOCAB, decay)


def latency(model, repeats: int = 20) -> float:
    from megatron_ext.elastic.measure import forward_latency

    tokens = torch.randint(0, VOCAB, (8, 256), generator=torch.Generator().manual_seed(0))
    return forward_latency(model, tokens, repeats)


def thinking_curve(model, space, sizes: dict, prompts: int, think_budgets: list[int]) -> list[dict]:
    """Answer accuracy / loss and wall time per thinking budget, for three (think, answer) pairs."""
    from megatron_ext.elastic.think_then_answer import generate_elastic

    pairs = {"think50-answer100": ("50", "100"), "think100-answer100": ("100", "100"), "think50-answer50": ("50", "50")}
    rows = []
    g = torch.Generator().manual_seed(777)
    cases = [example(a, b) for a, b in torch.randint(0, 10**DIGITS, (prompts, 2), generator=g).tolist()]
    for name, (think, answer) in pairs.items():
        for budget in think_budgets:
            correct, seconds, loss = 0, 0.0, 0.0
            for prompt, _, truth in cases:
                out = generate_elastic(model, space, prompt, VOCAB, sizes[think], sizes[answer], END_THINK, budget, len(truth), (EOS,))
                correct += out.answer == truth
                seconds += sum(p.seconds for p in out.phases.values())
                with space.at(sizes[answer]), torch.no_grad():
                    ids = torch.tensor([prompt + out.trace + truth])
                    logits = model(ids[:, :-1], torch.arange(ids.shape[1] - 1)[None], None)[0, -len(truth) :, :VOCAB]
                    loss += float(torch.nn.functional.cross_entropy(logits, ids[0, -len(truth) :]))
            rows.append({"pair": name, "think_budget": budget, "accuracy": correct / prompts,
                         "answer_loss": loss / prompts, "seconds_per_prompt": seconds / prompts})
    return rows


def distil_elastic(student, space, teacher, budgets: list[float], grid: dict, held: list[dict], args, seed: int):
    """Warm the router up, then distil every budget in one elastic run of seed `seed`:
    (distiller, held-out KD per budget before distillation)."""
    from megatron_ext.elastic.distill import CurriculumConfig, Distiller, train_plain
    from megatron_ext.elastic.router import BudgetRouter, RouterConfig

    router = BudgetRouter(budgets, grid, RouterConfig(anneal_steps=args.steps, lr=3e-2))
    curriculum = CurriculumConfig(
        budgets=budgets, uniform_steps=args.steps // 2, skew=args.skew, seed=seed, budget_draw=args.budget_draw
    )
    distiller = Distiller(space, teacher, router, curriculum, VOCAB)
    distiller.warm_up_router(args.router_warmup)
    kd_before = {b: distiller.heldout_kd(student, held, router.select(i)) for i, b in enumerate(budgets)}
    train_plain(
        distiller, student, lambda step: [train_batch(seed, step, args.batch)], args.steps, args.lr, decay=args.lr_decay
    )
    return distiller, kd_before


def fp8_comparison(
    student, space, distiller, qad, teacher, budgets: list[float], grid: dict, held: list[dict], teacher_logits: list, args
) -> list[dict]:
    """The FP8 (e4m3, parent's per-tensor scales) student per budget: the elastic run above
    quantised after training (PTQ) against the same run from the same reordered parent
    (`qad`, same batches, same router warm-up, seed 0) distilled with FP8 QAD. Held-out KD (against the
    full-precision teacher) and next-token loss, each run at its own router's sizes."""
    from megatron_ext.elastic import fp8
    from megatron_ext.elastic.space import ElasticSpace

    qad_space = ElasticSpace(qad)
    fp8.enable(qad)
    qad_distiller, _ = distil_elastic(qad, qad_space, teacher, budgets, grid, held, args, args.seeds[0])
    rows = []
    for i, b in enumerate(budgets):
        sizes, qad_sizes = distiller.router.select(i), qad_distiller.router.select(i)
        fp8.enable(student)
        with space.at(sizes):
            ptq_loss = heldout(student, held, teacher_logits)[0]
        row = {"budget": b, "sizes": sizes, "qad_sizes": qad_sizes, "kd_ptq": distiller.heldout_kd(student, held, sizes)}
        fp8.disable(student)
        row["kd_full_precision"] = distiller.heldout_kd(student, held, sizes)
        with qad_space.at(qad_sizes):
            qad_loss = heldout(qad, held, teacher_logits)[0]
        row |= {"kd_qad": qad_distiller.heldout_kd(qad, held, qad_sizes), "heldout_loss_ptq": ptq_loss, "heldout_loss_qad": qad_loss}
        rows.append(row)
    return rows


def parents() -> dict:
    from megatron_ext.config.schema import ModelConfig

    return {
        "gpt": ModelConfig(
            name="elastic_bench", num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=8,
            num_query_groups=4, seq_length=256, vocab_size=VOCAB, tie_embeddings=True, spec="local",
        ),
        # Mamba2 / attention / MoE / MLP layers (Nemotron-H style), pure-PyTorch Mamba2 mixer.
        "hybrid": ModelConfig(
            name="elastic_bench_hybrid", arch="hybrid", hybrid_pattern="M*ME-E", num_layers=6, hidden_size=128,
            ffn_hidden_size=256, num_attention_heads=8, num_query_groups=4, head_dim=16, num_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=128, mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16,
            mamba_chunk_size=32, seq_length=256, vocab_size=VOCAB, tie_embeddings=False, spec="local",
        ),
    }


@dataclasses.dataclass
class Parent:
    """The trained, calibrated and reordered parent every seed starts from."""

    cfg: object
    fresh: Callable[[], torch.nn.Module]
    state: dict
    teacher: torch.nn.Module
    grid: dict
    budgets: list[float]

    def reordered(self) -> torch.nn.Module:
        model = self.fresh()
        model.load_state_dict(self.state, strict=False)
        return model


@dataclasses.dataclass
class Replicate:
    """One seed of both arms: the elastic run (kept for the latency, thinking and FP8 parts) and
    (CE, KD) on the held-out set per budget name for the elastic and the baseline arm."""

    seed: int
    student: torch.nn.Module
    space: object
    distiller: object
    choices: dict
    subs: dict
    kd_before: dict
    elastic: dict
    baseline: dict


PADDED = 128


def train_parent(args) -> Parent:
    """Train the parent on next-token loss, calibrate and reorder it."""
    from megatron_ext.elastic.importance import calibrate
    from megatron_ext.elastic.permute import reorder
    from megatron_ext.elastic.plugin import default_grid
    from megatron_ext.elastic.router import check_budgets
    from megatron_ext.elastic.space import ElasticSpace
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.init import init_weights_layout_independent

    cfg = parents()[args.parent]

    def fresh():
        (m,) = build_model(cfg, PADDED)
        init_weights_layout_independent([m], m.config, args.seed)
        return m

    model = fresh()
    train_ce(model, args.parent_steps, args.batch, 3e-3)
    space = ElasticSpace(model)
    calib = [batch(50_000 + i, args.batch)["tokens"] for i in range(2)]
    calibrate(space.axes, calib, lambda t: model(t, torch.arange(SEQ)[None].expand(t.shape[0], -1), None))
    reorder(space.axes)
    teacher = fresh()
    teacher.load_state_dict(model.state_dict())
    teacher.eval().requires_grad_(False)
    budgets = [1.0, 0.75, 0.5]
    grid = default_grid(space, 8 if args.parent == "gpt" else 4)
    check_budgets(space, grid, budgets, 0.05)
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return Parent(cfg, fresh, state, teacher, grid, budgets)


def replicate(parent: Parent, seed: int, held: list[dict], teacher_logits: list, args) -> Replicate:
    """Seed `seed` of both arms: one elastic run, and each of its sizes pruned from the parent and
    distilled alone on the same batches."""
    from megatron_ext.elastic import slicing
    from megatron_ext.elastic.space import ElasticSpace

    student = parent.reordered()
    space = ElasticSpace(student)
    distiller, kd_before = distil_elastic(student, space, parent.teacher, parent.budgets, parent.grid, held, args, seed)
    choices = {f"{round(b * 100)}": distiller.router.select(i) for i, b in enumerate(parent.budgets)}
    subs, baseline = {}, {}
    for name, sizes in choices.items():
        subs[name], _ = slicing.export_submodel(student, parent.cfg, space, sizes, PADDED, name)
        base = parent.reordered()
        pruned, _ = slicing.export_submodel(base, parent.cfg, ElasticSpace(base), sizes, PADDED, name)
        train_kd(pruned, parent.teacher, args.steps, args.batch, args.lr, seed, args.lr_decay)
        baseline[name] = heldout(pruned, held, teacher_logits)
    elastic = {name: heldout(sub, held, teacher_logits) for name, sub in subs.items()}
    kd_before = {f"{round(b * 100)}": kd for b, kd in kd_before.items()}
    return Replicate(seed, student, space, distiller, choices, subs, kd_before, elastic, baseline)


def budget_row(budget: float, reps: list[Replicate], full_params: int, tokens: int) -> dict:
    """A budget's record: sizes, parameters and latency of seed 0, losses over the seeds."""
    from megatron_ext.elastic import slicing

    name, first = f"{round(budget * 100)}", reps[0]
    sizes = first.choices[name]
    params = slicing.param_count(first.subs[name])
    row = {
        "budget": budget, "sizes": sizes, "params_total": params, "params_active": int(first.space.active_params(sizes)),
        "params_analytic": int(first.space.params(sizes)), "params_fraction": params / full_params,
    }
    for prefix, arm in (("", "elastic"), ("baseline_", "baseline")):
        row |= seed_stats(f"{prefix}heldout_loss", [getattr(r, arm)[name][0] for r in reps])
        row |= seed_stats(f"{prefix}kd_loss", [getattr(r, arm)[name][1] for r in reps])
    return row | {
        "kd_loss_before": first.kd_before[name], "latency_s": latency(first.subs[name]),
        "tokens_elastic": tokens, "tokens_baseline": tokens,
    }


def difference(row: dict, key: str) -> dict:
    """Elastic minus baseline mean of `key` (held-out CE or KD) against two combined standard errors."""
    gap = row[key] - row[f"baseline_{key}"]
    ses = (row[f"{key}_se"], row[f"baseline_{key}_se"])
    two_se = 2 * math.hypot(*ses) if None not in ses else None
    return {"elastic_minus_baseline": gap, "two_combined_se": two_se, "within_noise": None if two_se is None else abs(gap) <= two_se}


def targets(rows: list[dict]) -> dict:
    full_latency = rows[0]["latency_s"]
    return {
        "heldout_within_2pct_of_baseline": {f"{r['budget']:g}": r["heldout_loss"] <= 1.02 * r["baseline_heldout_loss"] for r in rows},
        "heldout_difference": {f"{r['budget']:g}": difference(r, "heldout_loss") for r in rows},
        "kd_difference": {f"{r['budget']:g}": difference(r, "kd_loss") for r in rows},
        "elastic_tokens_at_most_baseline_total_over_n": rows[0]["tokens_elastic"] <= sum(r["tokens_baseline"] for r in rows) / len(rows),
        "latency_50_at_most_0.6x_full": rows[-1]["latency_s"] <= 0.6 * full_latency,
        "latency_50_over_full": rows[-1]["latency_s"] / full_latency,
    }


def run(args) -> dict:
    from megatron_ext.elastic import slicing

    t0 = time.perf_counter()
    held = heldout_set(args.heldout_samples)
    parent = train_parent(args)
    with torch.no_grad():
        teacher_logits = [parent.teacher(b["tokens"], b["position_ids"], None) for b in held]
    parent_loss = heldout(parent.teacher, held, teacher_logits)[0]
    reps = []
    for seed in args.seeds:
        reps.append(replicate(parent, seed, held, teacher_logits, args))
        print(f"seed {seed} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    first = reps[0]
    tokens_per_run = args.steps * args.batch * SEQ
    full_params = slicing.param_count(first.subs["100"])
    rows = [budget_row(b, reps, full_params, tokens_per_run) for b in parent.budgets]
    extra = {}
    if args.fp8:
        qad = parent.reordered()
        extra["fp8"] = fp8_comparison(
            first.student, first.space, first.distiller, qad, parent.teacher, parent.budgets, parent.grid, held, teacher_logits, args
        )
    return {
        "parent": f"{args.parent} (megatron {'GPTModel' if args.parent == 'gpt' else 'MambaModel'}, local spec): "
        + json.dumps(dataclasses.asdict(parent.cfg)),
        "parent_heldout_loss": parent_loss,
        "steps": args.steps, "budget_draw": args.budget_draw, "seeds": args.seeds, "heldout_samples": args.heldout_samples,
        "router_warmup": args.router_warmup, "skew": args.skew, "lr_decay": args.lr_decay, "batch": args.batch, "seq": SEQ, "parent_steps": args.parent_steps,
        "sizes_equal_over_seeds": all(r.choices == first.choices for r in reps),
        "notes": "heldout_loss / kd_loss (and baseline_*): mean over seeds, _se its standard error, _seeds per seed; "
        "sizes, params, kd_loss_before and latency_s (median of 20 forwards, 8x256 tokens, depends on machine load): "
        "seed 0 alone; thinking: seed 0.",
        "budgets": rows,
        "thinking": thinking_curve(first.student, first.space, first.choices, args.prompts, [0, 6, 12, 20]),
        "targets": targets(rows),
        **extra,
        "wall_s": time.perf_counter() - t0,
    }


# Settings that must agree for runs of different seeds to be one measurement.
SAME_SETTINGS = ("parent", "parent_heldout_loss", "steps", "budget_draw", "heldout_samples", "router_warmup", "skew",
                 "lr_decay", "batch", "seq", "parent_steps")
SEEDED = ("heldout_loss", "kd_loss", "baseline_heldout_loss", "baseline_kd_loss")


def merge(results: list[dict]) -> dict:
    """One result from runs of the same settings over disjoint seeds (e.g. run side by side on
    two cores): per-seed losses joined, means, errors and targets recomputed; seed-0 fields
    (sizes, latency, thinking) from the first run."""
    first = results[0]
    for other in results[1:]:
        differing = [k for k in SAME_SETTINGS if other.get(k) != first.get(k)]
        if differing:
            raise SystemExit(f"--merge: the runs differ in {', '.join(differing)}")
    seeds = [s for r in results for s in r["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: a seed occurs twice ({seeds})")
    rows = []
    for i, row in enumerate(first["budgets"]):
        row = dict(row)
        for key in SEEDED:
            row |= seed_stats(key, [v for r in results for v in r["budgets"][i][f"{key}_seeds"]])
        rows.append(row)
    sizes_equal = all(r["sizes_equal_over_seeds"] for r in results) and all(
        [b["sizes"] for b in r["budgets"]] == [b["sizes"] for b in first["budgets"]] for r in results)
    return first | {"seeds": seeds, "sizes_equal_over_seeds": sizes_equal, "budgets": rows, "targets": targets(rows),
                    "wall_s": sum(r["wall_s"] for r in results)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["budgets"]
    params = [r["params_total"] for r in rows]
    arms = (("heldout_loss", "o-", "nested (one elastic run)"), ("baseline_heldout_loss", "s--", "pruned + distilled separately"))
    for key, style, label in arms:
        ax1.errorbar(params, [r[key] for r in rows], [r[f"{key}_se"] or 0.0 for r in rows], fmt=style, capsize=3, label=label)
    ax1.set_xlabel("parameters")
    ax1.set_ylabel(f"held-out loss (mean ± se over {len(result['seeds'])} seeds)")
    ax1.legend()
    for pair in dict.fromkeys(r["pair"] for r in result["thinking"]):
        pts = [r for r in result["thinking"] if r["pair"] == pair]
        ax2.plot([r["seconds_per_prompt"] for r in pts], [r["answer_loss"] for r in pts], "o-", label=pair)
    ax2.set_xlabel("wall time per prompt (s), thinking budgets 0..20")
    ax2.set_ylabel("answer loss")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--parent")
    if mode.parse_known_args()[0].parent == "smollm2_135m":  # the real-model mode has its own options
        import elastic_real

        elastic_real.main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--parent-steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent", choices=("gpt", "hybrid", "smollm2_135m"), default="hybrid",
                        help="smollm2_135m: the real-model mode (scripts/bench/elastic_real.py, its own options)")
    parser.add_argument("--budget-draw", choices=("micro_batch", "sample"), default="micro_batch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds of both arms' distillation (budget draws, router noise, batch order); the parent is --seed's")
    parser.add_argument("--heldout-samples", type=int, default=512, help="held-out samples (a multiple of 64) for every loss")
    parser.add_argument("--lr-decay", action=argparse.BooleanOptionalAction, default=True,
                        help="both arms' learning rate falls linearly to zero (--no-lr-decay: constant)")
    parser.add_argument("--skew", type=float, nargs=3, default=[0.5, 0.3, 0.2],
                        help="budget draw probabilities (100%%, 75%%, 50%%) of the curriculum's second half")
    parser.add_argument("--router-warmup", type=int, default=300, help="cost-only router steps before distilling")
    parser.add_argument("--fp8", action="store_true", help="also compare FP8 QAD with FP8 after training (one more elastic run)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="write --json from these runs' results (same settings, disjoint seeds) instead of running")
    args = parser.parse_args()
    require(__file__, {"matplotlib": "--plot" if args.plot else None})
    if args.merge:
        result = {**merge([json.loads(Path(f).read_text()) for f in args.merge]), "provenance": provenance(__file__)}
        Path(args.json).write_text(json.dumps(result, indent=1))
        if args.plot:
            plot(result, args.plot)
        print(json.dumps({k: result[k] for k in ("budgets", "targets")}, indent=1))
        return
    torch.set_num_threads(1)
    cpu_compat.apply()
    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world():
        result = {**run(args), "provenance": provenance(__file__)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    print(json.dumps({k: result[k] for k in ("budgets", "targets", "fp8") if k in result}, indent=1))


if __name__ == "__main__":
    main()
