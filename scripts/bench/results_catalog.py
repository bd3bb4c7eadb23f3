"""The benchmarks that have a results page: for each results JSON, its title, the script that wrote
it, how its table is read from the JSON, and its targets, each judged met or missed.

Targets come from the JSON where the script judged them (`targets`, a row's `met`); where it
recorded only the measured ratios, `TARGETS` below holds the thresholds, with the place each
is stated. Every number shown on a page comes from the JSON; none is typed here but the
thresholds."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

# Thresholds the scripts did not write into their JSON, with where each is stated.
TARGETS = {
    # scripts/bench/lora.py `targets`: packed at least as fast as the jobs one after another
    # (per wall second and per CPU second), packed K=8 peak memory at most 1.5x a single job's.
    "lora_packed_over_sequential_at_least": 1.0,
    "lora_peak_mem_k8_over_single_at_most": 1.5,
    # scripts/bench/dpp.py `targets`: the speed-up targets hold at contexts of at least this many tokens.
    "dpp_speedup_from_context": 65536,
}


@dataclass(frozen=True)
class Target:
    name: str
    met: Optional[bool]  # None: no case to judge it on
    detail: str = ""


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass(frozen=True)
class Benchmark:
    results: str  # the JSON's name in scripts/bench/results/
    title: str
    plugin: str
    script: str
    about: str  # what was measured, in words (no numbers)
    tables: Callable[[dict], list[Table]]
    targets: Callable[[dict], list[Target]]
    notes: Callable[[dict], list[str]] = field(default=lambda data: [])

    @property
    def stem(self) -> str:
        return self.results.removesuffix(".json")


# ---- cells ----

def num(x, digits: int = 3) -> str:
    """A measured value as the pages show it: `digits` significant digits, thousands separated."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, list):
        return ", ".join(num(v, digits) for v in x)
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def mib(b) -> str:
    return "—" if b is None else num(b / 2**20)


def pct(x) -> str:
    return "—" if x is None else f"{num(100 * x)}%"


def with_se(mean, se) -> str:
    return num(mean) if se is None else f"{num(mean)} ± {num(se, 2)}"


def verdict(met: Optional[bool]) -> str:
    return {True: "met", False: "**missed**", None: "not judged"}[met]


def threshold(key: str) -> str:
    """The number a target's key names (`split_1.3x` -> 1.3, `speedup_target_1.15_met` -> 1.15)."""
    found = re.search(r"(\d+(?:\.\d+)?)", key)
    return found.group(1) if found else "?"


# ---- reshard.py ----

def reshard_tables(data: dict) -> list[Table]:
    header = ["transition", "model", "stall s", "stall, built at the switch, s", "prepare s", "moved MiB",
              "minimum MiB", "tmpfs ckpt s", "disk ckpt s", "restart s", "all-gather s", "tmpfs / stall",
              "restart / stall", "state equal"]
    rows = [[t["label"], t["model"], num(t["stall_s"]), num(t.get("stall_built_at_switch_s")), num(t.get("prepare_s")),
             mib(t.get("bytes_moved")), mib(t.get("bytes_min")), num(t.get("baseline_ckpt_tmpfs_s")),
             num(t.get("baseline_ckpt_disk_s")), num(t.get("baseline_restart_s")), num(t.get("baseline_gather_s")),
             num(t.get("ratio_ckpt_tmpfs_over_stall")), num(t.get("ratio_restart_over_stall")), num(t.get("state_equal"))]
            for t in data["transitions"]]
    sizes = [[name, num(size.get("params")), mib(size.get("state_bytes"))] for name, size in data["models"].items()
             if isinstance(size, dict)]
    tables = [Table(header, rows, "Per transition: medians over the repeats of the maximum over ranks.")]
    if sizes:
        tables.append(Table(["model", "parameters", "state MiB"], sizes))
    return tables


def reshard_targets(data: dict) -> list[Target]:
    out = []
    for name, judged in data["targets"].items():
        checked = judged.get("checked", 0)
        if not checked:
            out.append(Target(name, None, "no transition of this run applies"))
            continue
        missed = judged.get("missed", [])
        detail = f"{checked} transitions checked" + (f"; missed by {', '.join(missed)}" if missed else "")
        out.append(Target(name, judged["met"], detail))
    return out


def reshard_notes(data: dict) -> list[str]:
    return [f"Workers: {data['world']}; repeats: {data['repeats']}; training steps before the first transition: "
            f"{data['steps_before']}; staging budget per rank: {num(data['budget_mb'])} MB."]


# ---- reshard_transport.py ----

def transport_tables(data: dict) -> list[Table]:
    rows = [[route, num(data["median_s"][route]), ", ".join(num(s) for s in seconds)]
            for route, seconds in data["seconds"].items()]
    return [Table(["transport", "median s", "each repeat, s"], rows,
                  f"`{data['model']}`, {data['transition']}, {data['world']} workers: {mib(data['bytes_moved'])} MiB "
                  f"in {data['rounds']} rounds; messages / shared memory "
                  f"{num(data['ratio_messages_over_shared_memory'])}×; state arrived: {num(data['state_arrived'])}.")]


def no_targets(data: dict) -> list[Target]:
    return []


# ---- convert.py ----

def convert_tables(data: dict) -> list[Table]:
    rows = data["conversions"]
    timing = [[r["model"], r["label"], r.get("role") or "", " + ".join(map(str, r["workers"])), num(r["wall_s"]),
               num(r["load_s"]), num(r["save_s"]), num(r["wall_over_baseline"]), mib(r["peak_rss_bytes"]),
               num(r["load_average_1min"], 2)] for r in rows]
    moved = [[r["model"], r["label"], str(len(r["passes"])), mib(r["source_bytes"]), mib(r["output_bytes"]),
              mib(r["read_bytes"]), mib(r["written_bytes"]), num(r["read_over_source"]), num(r["written_over_output"])]
             for r in rows]
    return [
        Table(["model", "conversion", "", "workers per pass", "wall s", "load s", "save s", "wall / baseline",
               "peak RSS MiB", "load (1 min)"], timing,
              "Each conversion in a fresh process. Wall: the whole `relayout` call, the workers' start included; "
              "load and save: the slowest rank's, summed over the passes; peak RSS: the largest of any one process "
              "the conversion started (its workers, and the forkserver they are forked from); load: the machine's "
              "load average when the conversion ended."),
        Table(["model", "conversion", "passes", "source MiB", "output MiB", "read MiB", "written MiB",
               "read / source", "written / output"], moved,
              "Bytes read and written: every worker's, through read and write calls (Linux's rchar and wchar, the "
              "page cache included), during its load and its save; the minimum is the source's files to read and "
              "the output's to write."),
    ]


def convert_targets(data: dict) -> list[Target]:
    words = {"read_over_source": "bytes read at most {t}× the source", "written_over_output":
             "bytes written at most {t}× the output"}
    out = []
    for name, judged in data["targets"].items():
        key, passes = re.fullmatch(r"(.+)_(\d+)_pass", name).groups()
        missed = judged["missed"]
        detail = f"{judged['checked']} conversions checked" + (f"; missed by {', '.join(missed)}" if missed else "")
        out.append(Target(f"{words[key].format(t=num(judged['at_most']))}, conversions of {passes} "
                          f"pass{'es' if passes != '1' else ''}", judged["met"] if judged["checked"] else None, detail))
    return out


def convert_notes(data: dict) -> list[str]:
    layout = data["source_layout"]
    return [f"Source layout TP{layout['tp']}×PP{layout['pp']}; the whole run, training the sources included, took "
            f"{num(data['wall_s'])} s. No target on time or memory: the issue sets none."]


# ---- overhead.py ----

OVERHEAD_WAYS = {"plain": "plain PyTorch loop", "megatron_core": "bare Megatron-Core loop", "megatron_ext": "megatron_ext Trainer"}
OVERHEAD_PHASES = ("data", "forward", "backward", "grad_sync", "optimizer", "rest")


def overhead_tables(data: dict) -> list[Table]:
    tables = []
    for name, row in data["rows"].items():
        r = row["row"]
        body = [[OVERHEAD_WAYS[way], num(w["tokens_per_s"]), *(num(1e3 * w["phases_s"][p]) for p in OVERHEAD_PHASES),
                 num(w["peak_rss_gb"])] for way, w in row["ways"].items()]
        tables.append(Table(
            ["way", "tokens/s", *(f"{p} ms" for p in OVERHEAD_PHASES), "peak RSS GB"], body,
            f"{name}: {r['model']}, {r['nproc']} rank(s), global batch {r['global_batch']} × {r['seq_length']} tokens, "
            f"micro-batch {r['micro_batch']}. Per step, the slowest rank's mean over the timed steps; `rest` is the "
            "step's time the named phases leave (the loop itself: logging, metrics, checks)."))
    return tables


def overhead_targets(data: dict) -> list[Target]:
    out = []
    for name, t in data["targets"].items():
        bound = f"at least {num(t['at_least'])}" if "at_least" in t else f"at most {num(t['at_most'])}"
        out.append(Target(f"{name} {bound}", t["met"], f"measured {num(t['value'])}"))
    return out


def phase_gaps(slower: dict, faster: dict) -> str:
    """The phases where `slower` spends more per step than `faster`, largest first, in ms."""
    gaps = sorted(((slower["phases_s"][p] - faster["phases_s"][p], p) for p in OVERHEAD_PHASES), reverse=True)
    return ", ".join(f"{p} +{num(1e3 * g)} ms" for g, p in gaps if g > 0) or "none"


def overhead_gaps(ways: dict) -> str:
    """Which part of the gap to the plain loop is megatron-core's and which is megatron_ext's."""
    return (f"megatron-core against the plain loop: {phase_gaps(ways['megatron_core'], ways['plain'])}; "
            f"megatron_ext against the bare Megatron-Core loop: {phase_gaps(ways['megatron_ext'], ways['megatron_core'])}.")


def overhead_notes(data: dict) -> list[str]:
    rounds = data.get("rounds", 1)
    notes = [f"{data['steps']} timed steps after {data['warmup']} warm-up steps per run; each way ran {rounds} "
             f"time(s), interleaved, and is shown by its median run; the whole benchmark took {num(data['wall_s'])} s."]
    for name, row in data["rows"].items():
        spread = "; ".join(f"{OVERHEAD_WAYS[way]} " + ", ".join(num(t) for t in w["rounds_tokens_per_s"])
                           for way, w in row["ways"].items() if "rounds_tokens_per_s" in w)
        if spread:
            notes.append(f"{name}, tokens/s of every run: {spread}.")
        notes.append(f"{name}: " + overhead_gaps(row["ways"]))
    if "trace" in data:
        top = ", ".join(f"{op['name']} {num(op['self_cpu_ms'])} ms" for op in data["trace"]["top_ops"][:8])
        notes.append(f"torch.profiler over 3 steps of the Trainer on {data['trace']['row']} (rank 0), the largest "
                     f"self CPU times: {top}.")
    return notes


# ---- scale.py ----

def scale_simulated(row: dict) -> str:
    sim = row.get("simulated") or {}
    if row["plugin"] == "dpp":
        return f"iteration {num(sim.get('iter_s'))} s; planner / iteration at most {pct(sim.get('planner_over_iter_max'))}"
    if row["plugin"] == "lora":
        base = ", ".join(f"{k} " + ("none" if v is None else f"{num(v)} s") for k, v in sim.get("baseline_makespan_s", {}).items())
        return f"makespan {num(sim.get('makespan_s'))} s; {base}; lower bound {num(sim.get('lower_bound_s'))} s"
    moved = row.get("bytes", {})
    return (f"stall {num(sim.get('stall_s'))} s ({sim.get('rounds')} rounds); checkpoint route "
            f"{num(sim.get('checkpoint_route_s'))} s; bytes = minimum: "
            + ("not checked" if moved.get("equal_min") is None else num(moved["equal_min"])))


def scale_tables(data: dict) -> list[Table]:
    rows = [[r["plugin"], r["case"], num(r["planner_wall_s"]), num(r["planner_cpu_s"]), mib(r.get("peak_rss_bytes")),
             num(r.get("load_average_1min"), 2), scale_simulated(r)] for r in data["rows"]]
    return [Table(["plugin", "case", "planner wall s", "planner CPU s", "peak RSS MiB", "load (1 min)",
                   "simulated on the H100-class cluster"], rows)]


def scale_targets(data: dict) -> list[Target]:
    return [Target(f"{r['case']}: {r['target']}", r["met"],
                   f"judged on the wall clock; on CPU time: {verdict(r.get('met_cpu'))}") for r in data["rows"]]


# ---- dpp.py ----

DPP_TARGETS = {
    "split_1.3x": ("vs_split", "DPP at least {t}× faster than static token-split at contexts of {c}K and above"),
    "packed_1.5x": ("vs_packed", "DPP at least {t}× faster than packing with uniform recompute at contexts of {c}K and above"),
    "bubble_below_20pct": (None, "DPP's pipeline bubble below {t}% of the iteration, every configuration"),
    "dpp_within_budget": (None, "no DPP plan over the memory budget"),
}


def ratio(row: dict, base: str) -> str:
    value = row.get(f"vs_{base}")
    return num(value) + (" (OOM)" if row.get(f"{base}_oom") else "")


def dpp_tables(data: dict) -> list[Table]:
    rows = [[r["model"], f"{r['context'] // 1024}K", str(r["pp"]), r["distribution"], ratio(r, "packed"), ratio(r, "split"),
             ratio(r, "chunkflow"), pct(r.get("dpp_bubble"))] for r in data["targets"]["rows"]]
    return [Table(["model", "context", "PP", "lengths", "DPP vs packed", "DPP vs split", "DPP vs ChunkFlow-like",
                   "DPP bubble"], rows, "Speed-ups are the baseline's simulated iteration over DPP's on the same batch; "
                                       "(OOM): the baseline's plan exceeds the memory budget.")]


def dpp_targets(data: dict) -> list[Target]:
    out = []
    for key, met in data["targets"]["met"].items():
        column, text = DPP_TARGETS.get(key, (None, key))
        detail = ""
        if column:
            wanted = float(threshold(key))
            judged = [r[column] for r in data["targets"]["rows"]
                      if r["context"] >= TARGETS["dpp_speedup_from_context"] and r.get(column) is not None]
            detail = f"met in {sum(v >= wanted for v in judged)} of {len(judged)} configurations"
        out.append(Target(text.format(t=threshold(key), c=TARGETS["dpp_speedup_from_context"] // 1024), met, detail))
    return out


# ---- dpp_measured.py ----

def dpp_measured_tables(data: dict) -> list[Table]:
    rows = [[num(r["budget_fraction"]), r["policy"], num(r["iter_s"]), num(r.get("predicted_iter_s")),
             mib(r.get("peak_act_bytes")), mib(r.get("budget_bytes")), num(r.get("fits")), pct(r.get("act_bytes_error")),
             "infeasible" if r["infeasible"] else ""] for r in data["measured"]]
    return [Table(["budget (of no-recompute memory)", "policy", "iteration s (median)", "predicted s", "peak activations MiB",
                   "budget MiB", "fits", "activation error", ""], rows)]


def dpp_measured_targets(data: dict) -> list[Target]:
    out = []
    for key, judged in data["targets"].items():
        if key.startswith("budget_fraction_") and isinstance(judged, dict):
            target_key = next((k for k in judged if k.startswith("speedup_target_")), None)
            if target_key is None:
                out.append(Target(f"at {key.removeprefix('budget_fraction_')} of the no-recompute memory: DPP fits",
                                  judged.get("dpp_fits_budget")))
                continue
            out.append(Target(
                f"at {key.removeprefix('budget_fraction_')} of the no-recompute memory: DPP at least "
                f"{threshold(target_key)}× faster than the fastest static policy that fits", judged[target_key],
                f"{num(judged['dpp_speedup_over_best_fitting_static'])}× against {judged['best_fitting_static']}"))
        elif key.startswith("act_bytes_error_target_"):
            out.append(Target(f"measured activation peaks within {pct(float(threshold(key)))} of the cost model's "
                              "count", judged,
                              f"largest error {pct(data['targets'].get('act_bytes_error_max'))}"))
    return out


# ---- dpp_plan_ahead.py ----

PLAN_AHEAD_COLUMNS = {"step_s": "step s (median)", "wait_s": "wait for the plan s", "forward_backward_s": "forward-backward s",
                      "planning_wall_s": "planning wall s", "planning_thread_cpu_s": "planning CPU s",
                      "first_step_s": "first step of each block s"}


def plan_ahead_tables(data: dict) -> list[Table]:
    rows = [[arm, *(num(values.get(k)) for k in PLAN_AHEAD_COLUMNS)] for arm, values in data["arms"].items()]
    return [Table(["arm", *PLAN_AHEAD_COLUMNS.values()], rows,
                  f"Speed-up of planning ahead (at_step / ahead): median step {num(data['speedup'])}×, per batch "
                  f"(median) {num(data['speedup_per_batch_median'])}×, summed steps {num(data['speedup_total'])}×; "
                  f"plans identical in both arms: {num(data['plans_identical']['all'])}.")]


# ---- elastic.py ----

def elastic_tables(data: dict) -> list[Table]:
    rows = [[f"{num(100 * b['budget'])}%", ", ".join(f"{k} {v}" for k, v in b["sizes"].items()), num(b["params_total"]),
             with_se(b["heldout_loss"], b.get("heldout_loss_se")),
             with_se(b["baseline_heldout_loss"], b.get("baseline_heldout_loss_se")),
             with_se(b["kd_loss"], b.get("kd_loss_se")), with_se(b.get("baseline_kd_loss"), b.get("baseline_kd_loss_se")),
             num(b.get("latency_s")), num(b.get("tokens_elastic")), num(b.get("tokens_baseline"))] for b in data["budgets"]]
    tables = [Table(["budget", "sizes", "parameters", "elastic held-out loss", "separate held-out loss", "elastic KD loss",
                     "separate KD loss", "latency s", "tokens, elastic", "tokens, separate"], rows,
                    f"Parent held-out loss {num(data['parent_heldout_loss'])}; "
                    + (f"mean ± standard error over seeds {data['seeds']}." if "seeds" in data else "one seed."))]
    if "fp8" in data:
        fp8 = [[f"{num(100 * r['budget'])}%", num(r["kd_ptq"]), num(r["kd_full_precision"]), num(r["kd_qad"]),
                num(r["heldout_loss_ptq"]), num(r["heldout_loss_qad"])] for r in data["fp8"]]
        tables.append(Table(["budget", "KD loss, FP8 after training", "KD loss, full precision", "KD loss, FP8 QAD",
                             "held-out loss, FP8 after training", "held-out loss, FP8 QAD"], fp8, "FP8 quantisation."))
    return tables


def elastic_targets(data: dict) -> list[Target]:
    judged = data["targets"]
    out = []
    for key, per_budget in judged.items():
        if key.startswith("heldout_within_"):
            for budget, met in per_budget.items():
                out.append(Target(f"{num(100 * float(budget))}% budget: elastic held-out loss within "
                                  f"{threshold(key)}% of the separately distilled model's", met))
    if "elastic_tokens_at_most_baseline_total_over_n" in judged:
        out.append(Target("elastic run's tokens at most the separate runs' total over the number of budgets",
                          judged["elastic_tokens_at_most_baseline_total_over_n"]))
    for key, met in judged.items():
        if key.startswith("latency_50_at_most_"):
            out.append(Target(f"50% model's forward at most {threshold(key.removeprefix('latency_50_at_most_'))}× the full "
                              "model's", met, f"{num(judged.get('latency_50_over_full'))}×"))
    return out


def elastic_notes(data: dict) -> list[str]:
    return [data["notes"]] if isinstance(data.get("notes"), str) else []


# ---- elastic.py --parent smollm2_135m (elastic_real.py) ----

def elastic_real_tables(data: dict) -> list[Table]:
    rows = [[f"{num(100 * b['budget'])}%", ", ".join(f"{k} {v}" for k, v in b["sizes"].items()), num(b["params"]),
             num(b["ppl_parent"]), with_se(b["ppl_elastic"], b.get("ppl_elastic_se")),
             with_se(b.get("ppl_separate"), b.get("ppl_separate_se")), num(b.get("ppl_pruned")),
             with_se(b.get("kd_elastic"), b.get("kd_elastic_se")), with_se(b.get("kd_separate"), b.get("kd_separate_se")),
             num(b.get("latency_ratio"))] for b in data["budgets"]]
    plan = data["plan"]
    tables = [Table(["budget", "sizes", "parameters", "parent perplexity", "elastic perplexity", "separate perplexity",
                     "pruned perplexity", "elastic KD loss", "separate KD loss", "latency over the parent"], rows,
                    f"Held-out perplexity, mean ± standard error over seeds {plan['seeds']}; sequence {plan['seq']}, "
                    f"{plan['steps']} steps, {plan['tokens_per_arm']} tokens per arm.")]
    export = [[f"{budget}%", num(v["max_abs"]), num(v["max_logit"])] for budget, v in data.get("hf_export", {}).items()]
    if export:
        tables.append(Table(["budget", "largest absolute logit difference, transformers against elastic", "largest logit"],
                            export, "The exported submodels in `transformers`."))
    thinking = [[r["pair"], num(r["tokens_per_s"]), num(r["seconds_per_prompt"])] for r in data.get("thinking", [])]
    if thinking:
        tables.append(Table(["think / answer budgets", "tokens/s", "seconds per prompt"], thinking,
                            "Think-small / answer-large generation."))
    return tables


def elastic_real_targets(data: dict) -> list[Target]:
    judged = data["targets"]
    out = []
    for key, per_budget in judged.items():
        if key.startswith("elastic_within_") and isinstance(per_budget, dict):
            for budget, met in per_budget.items():
                out.append(Target(f"{budget}% budget: elastic perplexity within {threshold(key)}% of the separately "
                                  "distilled model's", met))
        elif key.startswith("full_within_"):
            out.append(Target(f"the elastic model's 100% budget within {threshold(key)}% of the parent's perplexity",
                              per_budget))
        elif key.startswith("latency_50_at_most_"):
            out.append(Target(f"50% model's latency at most {threshold(key.removeprefix('latency_50_at_most_'))}× the "
                              "parent's", per_budget))
    for budget, gap in judged.get("elastic_minus_separate", {}).items():
        out.append(Target(f"{budget}% budget: elastic minus separate perplexity within two combined standard errors",
                          gap.get("within_noise"), f"{num(gap['difference'])} against {num(gap['two_combined_se'])}"))
    for budget, arms in judged.get("trained_beat_pruned", {}).items():
        for arm, met in arms.items():
            out.append(Target(f"{budget}% budget: the {arm} model's perplexity below pruning alone", met))
    ratio = judged.get("elastic_tokens_over_separate_total")
    if ratio is not None:
        # One elastic run against one separate run per budget (the 100 % one included):
        # 1/3 with three budgets.
        per = 1 / len(data["budgets"])
        out.append(Target(f"the elastic run's tokens at most 1/{len(data['budgets'])} of the separate runs' total",
                          ratio <= per + 1e-12, f"{num(ratio)}"))
    return out


def elastic_real_notes(data: dict) -> list[str]:
    return [data["notes"]] if isinstance(data.get("notes"), str) else []


# ---- reshard_simulate.py ----

SIMULATE_WITHIN = "within_25pct"  # the key reshard_simulate.py counts its predictions under


def simulate_tables(data: dict) -> list[Table]:
    rows = []
    for source, parts in data["summary"].items():
        for part, s in parts.items():
            if s:
                rows.append([source, part, f"{s[SIMULATE_WITHIN]} of {s['of']}", pct(s["median_abs_error"]),
                             pct(s["max_abs_error"])])
    tables = [Table(["measured in", "time", f"predicted within {threshold(SIMULATE_WITHIN)}%", "median error",
                     "largest error"], rows,
                    "The stall simulator's prediction on this machine's fitted constants against the measured live "
                    "reshards.")]
    spread = [[source, f"{s[SIMULATE_WITHIN]} of {s['of']}", pct(s["median_abs_error"]), pct(s["max_abs_error"])]
              for source, s in data.get("run_to_run_spread", {}).items()]
    if spread:
        tables.append(Table(["stored run", f"this run's stall within {threshold(SIMULATE_WITHIN)}%", "median difference",
                             "largest difference"], spread,
                            "The machine's own spread: the same transitions' stalls measured in this run against a "
                            "stored run (no model can predict both closer than they agree)."))
    return tables


def simulate_targets(data: dict) -> list[Target]:
    return [Target(f"{source}: the simulated stall within {threshold(SIMULATE_WITHIN)}% of the measured one, every "
                   "transition", parts["stall_s"][SIMULATE_WITHIN] == parts["stall_s"]["of"],
                   f"{parts['stall_s'][SIMULATE_WITHIN]} of {parts['stall_s']['of']}")
            for source, parts in data["summary"].items() if parts.get("stall_s")]


# ---- lora.py ----

def lora_run(r: dict) -> str:
    return r["mode"] + (f" (pass cap {r['pass_cap']})" if r.get("pass_cap") not in (None,) else "")


def lora_tables(data: dict) -> list[Table]:
    rows = [[str(r["k"]), str(r["batch"]), lora_run(r), num(r["tokens_per_s"]), num(r["tokens_per_cpu_s"]),
             mib(r.get("peak_mem_bytes"))] for r in data["throughput"]]
    return [Table(["jobs K", "batch", "run", "tokens/s", "tokens per CPU s", "peak memory MiB"], rows)]


LORA_KEY = re.compile(r"(?P<run>.+?)_(?:vs_sequential|peak_mem)_k(?P<k>\d+)(?:_over_single)?_b(?P<batch>\d+)")


def lora_case(key: str) -> str:
    found = LORA_KEY.fullmatch(key)
    return f"K={found['k']}, batch {found['batch']}, {found['run'].replace('_', ' ')}" if found else key


def lora_targets(data: dict) -> list[Target]:
    out = []
    floor = TARGETS["lora_packed_over_sequential_at_least"]
    ceiling = TARGETS["lora_peak_mem_k8_over_single_at_most"]
    for key, value in data["throughput_targets"].items():
        if isinstance(value, dict):
            out.append(Target(f"{lora_case(key)}: tokens per second at least {num(floor)}× the jobs' one after "
                              "another, by the wall clock and by CPU time", value["wall"] >= floor and value["cpu"] >= floor,
                              f"wall {num(value['wall'])}×, CPU {num(value['cpu'])}×"))
        else:
            out.append(Target(f"{lora_case(key)}: peak memory at most {num(ceiling)}× one job's alone", value <= ceiling,
                              f"{num(value)}×"))
    return out


def lora_sweep_tables(data: dict) -> list[Table]:
    sweep = data["sweep"]
    measured = sweep.get("measured_details", {})
    rows = [[name, num(sweep.get("measured", {}).get(name)), num(measured.get("makespan_wall_s", {}).get(name)),
             num(measured.get("predicted_s", {}).get(name)), num(sweep["simulated"].get(name))] for name in sweep["simulated"]]
    return [Table(["strategy", "measured makespan, CPU s of the busiest rank", "measured wall s", "predicted s",
                   "simulated makespan s (8 GPUs)"], rows,
                  f"Heuristic planner's worst makespan over the exact optimum on small sweeps: "
                  f"{num(sweep['small_instance_max_gap'])}×.")]


def lora_sweep_targets(data: dict) -> list[Target]:
    out = []
    for part in ("measured", "simulated"):
        makespans = data["sweep"].get(part)
        if makespans:
            best = min((v, k) for k, v in makespans.items() if k != "planner" and v is not None)
            out.append(Target(f"{part}: the planner's makespan no worse than the best baseline's", makespans["planner"] <= best[0],
                              f"planner {num(makespans['planner'])} against {best[1]} {num(best[0])}"))
    return out


RESHARD_ABOUT = ("One launch of CPU workers changes the parallel layout of a training job by five routes from the same "
                 "state: the live reshard, all-gather then slice, a checkpoint through tmpfs, a checkpoint on disk, "
                 "and a restarted job; every route's state is compared bitwise with the live route's.")
ELASTIC_REAL_ABOUT = ("SmolLM2-135M-Instruct as the parent, on the Python standard library's text split by file: "
                      "one elastic run against pruning alone and against pruning then distilling each size "
                      "separately on the same windows.")
ELASTIC_ABOUT = ("One elastic distillation run trains nested submodels at every budget; each is compared with pruning "
                 "and distilling that size alone with the same tokens per size.")

BENCHMARKS = [
    Benchmark("reshard_tiny_cpu.json", "reshard: tiny models", "reshard", "scripts/bench/reshard.py", RESHARD_ABOUT,
              reshard_tables, reshard_targets, reshard_notes),
    Benchmark("reshard_100m_cpu.json", "reshard: 100M-parameter models", "reshard", "scripts/bench/reshard.py",
              RESHARD_ABOUT, reshard_tables, reshard_targets, reshard_notes),
    Benchmark("reshard_cp_tiny_cpu.json", "reshard: context parallelism", "reshard", "scripts/bench/reshard.py",
              RESHARD_ABOUT, reshard_tables, reshard_targets, reshard_notes),
    Benchmark("reshard_pool_tiny_cpu.json", "reshard: growing and shrinking the worker pool", "reshard",
              "scripts/bench/reshard.py", RESHARD_ABOUT, reshard_tables, reshard_targets, reshard_notes),
    Benchmark("reshard_transport_cpu.json", "reshard: shared memory against gloo messages", "reshard",
              "scripts/bench/reshard_transport.py",
              "The reshard executor moves one training state between layouts, through shared memory and as gloo "
              "messages.", transport_tables, no_targets),
    Benchmark("reshard_simulate_cpu.json", "reshard: the stall simulator against measured reshards", "reshard",
              "scripts/bench/reshard_simulate.py",
              "The reshard stall simulator, its constants fitted on this machine, predicts the live reshards measured "
              "here and in the reshard results files; each prediction is set against the measurement.",
              simulate_tables, simulate_targets),
    Benchmark("convert_cpu.json", "reshard: the offline converter", "reshard", "scripts/bench/convert.py",
              "The offline converter (`python -m megatron_ext.reshard.convert`) rewrites a TP2×PP2 checkpoint, "
              "trained one step, in other layouts: from the fully_reshardable checkpoint training saves (one pass) "
              "and from a dp_reshardable one (two passes, through its own layout first). Its time, its workers' "
              "peak memory and the bytes it reads and writes, against the checkpoint's size.",
              convert_tables, convert_targets, convert_notes),
    Benchmark("scale.json", "Planners at cluster scale", "all", "scripts/bench/scale.py",
              "Each plugin's planner runs here on the sizes a cluster gives it; its plan is priced by the plugin's "
              "simulator on an H100-class cluster.", scale_tables, scale_targets),
    Benchmark("dpp.json", "dpp: simulated", "dpp", "scripts/bench/dpp.py",
              "DPP against static policies on the analytic GPU cost model (LLaMA-7B / 13B, long contexts).",
              dpp_tables, dpp_targets),
    Benchmark("dpp_measured_median.json", "dpp: measured on CPU", "dpp", "scripts/bench/dpp_measured.py",
              "Real PP=2 iterations on 2 CPU workers: DPP against static policies at activation budgets that make "
              "recompute bind.", dpp_measured_tables, dpp_measured_targets),
    Benchmark("dpp_plan_ahead.json", "dpp: planning ahead", "dpp", "scripts/bench/dpp_plan_ahead.py",
              "Real PP=2 steps on 2 CPU workers, planning the next batch while the step trains against planning at "
              "each step, on the same batches and plans.", plan_ahead_tables, no_targets),
    Benchmark("elastic_hybrid_seeds_cpu.json", "elastic: hybrid MoE parent over seeds", "elastic", "scripts/bench/elastic.py",
              ELASTIC_ABOUT, elastic_tables, elastic_targets, elastic_notes),
    Benchmark("elastic_hybrid_cpu.json", "elastic: hybrid MoE parent, one seed", "elastic", "scripts/bench/elastic.py",
              ELASTIC_ABOUT, elastic_tables, elastic_targets, elastic_notes),
    Benchmark("elastic_cpu.json", "elastic: dense LLaMA parent", "elastic", "scripts/bench/elastic.py",
              ELASTIC_ABOUT, elastic_tables, elastic_targets, elastic_notes),
    Benchmark("elastic_hybrid_fp8_cpu.json", "elastic: FP8 quantisation-aware distillation", "elastic",
              "scripts/bench/elastic.py", ELASTIC_ABOUT + " With FP8: QAD against quantising after training.",
              elastic_tables, elastic_targets, elastic_notes),
    Benchmark("elastic_smollm2_cpu.json", "elastic: SmolLM2-135M parent on the standard library's text", "elastic",
              "scripts/bench/elastic.py", ELASTIC_REAL_ABOUT, elastic_real_tables, elastic_real_targets, elastic_real_notes),
    Benchmark("overhead_cpu.json", "Runtime overhead against a plain PyTorch loop", "all", "scripts/bench/overhead.py",
              "The same model shapes, batch and machine trained three ways, each in fresh worker processes: a plain "
              "PyTorch loop (transformers' LLaMA, torch DDP, AdamW), a bare Megatron-Core loop (its GPTModel from its local "
              "layer spec, DDP, distributed optimizer and schedule, no Trainer) and megatron_ext's Trainer; tokens per second, peak "
              "memory and where a step's time goes.", overhead_tables, overhead_targets, overhead_notes),
    Benchmark("lora_throughput.json", "lora: packed throughput", "lora", "scripts/bench/lora.py",
              "K LoRA jobs on one frozen base: packed in one model against one job after another and against K "
              "processes.", lora_tables, lora_targets),
    Benchmark("lora_throughput_b4_repeat.json", "lora: packed throughput at batch 4, repeated", "lora",
              "scripts/bench/lora.py", "The batch-4 half of the throughput benchmark, measured over more repeats.",
              lora_tables, lora_targets),
    Benchmark("lora_sweep_cpu.json", "lora: sweep makespan", "lora", "scripts/bench/lora_sweep.py",
              "A LoRA sweep's makespan under the planner against the baseline strategies: a 12-job sweep run on 2 "
              "CPU ranks, and a simulated GPU sweep.", lora_sweep_tables, lora_sweep_targets),
]
