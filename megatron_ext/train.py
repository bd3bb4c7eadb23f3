"""Entrypoint: `python -m megatron_ext.train [key=value ...]`.

    python -m megatron_ext.train                          # the default experiment (4 CPU workers)
    python -m megatron_ext.train parallel.tp=2 launcher.nproc=2 train.iters=50
    torchrun --nproc-per-node 8 -m megatron_ext.train parallel.tp=8   # launched from outside
    python -m megatron_ext.train -m hydra/launcher=slurm ...          # Hydra multirun / SLURM
    python -m megatron_ext.train -m experiment=lora_sweep lora.rank=8,16 optim.lr=1e-4,3e-4
                                         # a multirun a plugin owns (`Plugin.multirun`): here
                                         # ONE packed run of all LoRA combinations

A plain run composes the config with Hydra's compose API, so every bad input (an unknown key, a
wrong type, a broken rule between fields) ends as one `error: ...` line and exit code 2 before
anything is written. Runs with Hydra's own flags (`-m`, `--cfg`, `--help`, ...) go through
`@hydra.main`, which owns multirun sweeps and launcher plugins.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import hydra
from hydra._internal.utils import get_args_parser
from omegaconf import DictConfig

from megatron_ext.checkpointing import writer_lock
from megatron_ext.config import Config, compose_config, register_configs, to_object
from megatron_ext.config.validate import ConfigError, validate_run, world_size_of
from megatron_ext.platform.launch_env import detect_launch
from megatron_ext.platform.local_workers import LaunchAborted, LaunchFailed, LaunchRefused
from megatron_ext.config.sweep import read_sweep
from megatron_ext.plugin import Runner, build_plugins, plugin_classes

register_configs()


def preflight(cfg: Config) -> None:
    """Refuse, before anything is launched or written, a config that cannot run: the rules of
    config/validate.py with each plugin's own `check` and `check_layout`, a `checkpoint.save`
    that another run writes to (checkpointing/writer_lock.py), then the files the run reads and
    the checkpoint directory it writes (training/preflight.py).

    `cfg` is the composed run config; the world it is checked for is what torchrun or srun set
    up, else `launcher.nproc`. A run whose workers start here and that resumes a
    `dp_reshardable` checkpoint of another layout has it rewritten in its layout first
    (training/relayout.py). Returns nothing when the run can start. Raises ConfigError (one
    line naming the field and the rule: the command line exits 2 with it) or a plugin's
    ValueError for the first setting that cannot work.
    """
    validate_run(cfg, world_size_of(cfg))
    if _owns_the_save_dir(cfg):  # before the checks that take seconds
        writer_lock.check_free(cfg.checkpoint.save)
    from megatron_ext.training.preflight import check_inputs  # torch: only for a config the rules accept

    launched_here = detect_launch() is None
    if launched_here and _resumes(cfg):  # workers started here: a checkpoint of another layout can be rewritten first
        from megatron_ext.training.relayout import prepare_resume  # torch and megatron: only for a run that resumes

        note = prepare_resume(cfg)
        if note is not None:
            print(f"notice: {note}", file=sys.stderr)
    # Under torchrun or srun every rank runs this: the ranks tokenize SFT data together instead.
    check_inputs(cfg, tokenize_sft=launched_here)


def _owns_the_save_dir(cfg: Config) -> bool:
    """Whether this process holds the writer lock of the run's `checkpoint.save`: the one that
    starts local workers or runs alone, rank 0 under torchrun or srun (the other ranks' rank 0
    holds it). A train.skip_train run writes nothing there: no lock."""
    launch = detect_launch()
    return bool(cfg.checkpoint.save) and not cfg.train.skip_train and (launch is None or launch.rank == 0)


@contextlib.contextmanager
def holding_the_save_dir(cfg: Config) -> Iterator[None]:
    """Hold the writer lock of `checkpoint.save` for the block, in the process that owns the
    run (`_owns_the_save_dir`); it removes leftovers of broken saves when taken. Raises
    ConfigError when another run holds it."""
    if not _owns_the_save_dir(cfg):
        yield
        return
    save = cfg.checkpoint.save
    lock = writer_lock.take(save)
    if lock.previous is not None:
        print(f"notice: checkpoint.save: took over {save} from {lock.previous}, which ended without releasing it", file=sys.stderr)
    if lock.unlocked_because is not None:
        print(
            f"warning: checkpoint.save: {save} cannot be locked ({lock.unlocked_because}): nothing keeps another "
            "run from writing there, and leftovers of broken saves stay",
            file=sys.stderr,
        )
    try:
        yield
    finally:
        lock.release()


def _resumes(cfg: Config) -> bool:
    """Whether `checkpoint.load` holds a checkpoint to resume, read from its tracker alone (a
    damaged one is preflight's to name)."""
    from megatron_ext.checkpointing import tracker  # no torch

    load = cfg.checkpoint.load
    try:
        return bool(load) and (cfg.checkpoint.step is not None or tracker.latest_iteration(load) is not None)
    except ValueError:
        return False


def run(cfg: Config) -> Optional[dict]:
    """Validate, then train in this process or in `launcher.nproc` local workers. Returns the
    run summary (from rank 0, the reporting rank, when workers were started here).

    `cfg` is the composed run config (`config.store.compose_config` builds one from command-line
    overrides). Under torchrun or srun, or with `launcher.nproc` 1, this process is one rank and
    runs the Trainer's loop, or the Runner of the plugin that owns the run (`Plugin.runner`);
    otherwise it starts the local workers and waits for them. The summary is the Runner's dict
    (the Trainer's: iterations, losses, tokens per second and the checkpoint written); None on
    the ranks that do not report. The process that owns the run holds the writer lock of
    `checkpoint.save` throughout (`holding_the_save_dir`). Raises ConfigError from `preflight`
    or the lock before anything starts; from the local launcher, LaunchRefused when a worker refused input only the ranks read (a
    damaged checkpoint), LaunchAborted after a second pre-emption signal or at its deadline, and
    LaunchFailed when a worker failed.
    """
    preflight(cfg)
    with holding_the_save_dir(cfg):
        runner = runner_of(cfg)
        if detect_launch() is None and cfg.launcher.nproc > 1:
            from megatron_ext.platform.launch import launch_local  # torch: once the config is accepted

            launcher = cfg.launcher
            results = launch_local(
                launcher.nproc,
                worker,
                (cfg,),
                launcher.master_addr,
                launcher.master_port,
                launcher.max_restarts,
                launcher.preempt_timeout_s if runner.stops_at_a_step else None,
                refusals=(ConfigError,),  # input only the ranks read: a damaged checkpoint
            )
            return results[0]
        return worker(cfg)


def runner_of(cfg: Config) -> Runner:
    """What each worker runs: the run's plugin that owns the run (`Plugin.runner`), else the
    Trainer's loop."""
    # Validation refuses two plugins that supply runners (config/capabilities.py: OWNS_RUN).
    owners = [r for p in build_plugins(cfg.plugins, cfg) if (r := p.runner()) is not None]
    return owners[0] if owners else Runner(train_one_world)


def worker(cfg: Config) -> dict:
    """One rank: run the run's Runner. Where it stops at a step boundary, a pre-emption signal
    from the rank's start on stops it there, with a checkpoint (training/preemption.py)."""
    from megatron_ext.training.preemption import stop_request  # torch: off the path of a refused command line

    runner = runner_of(cfg)
    if not runner.stops_at_a_step:
        return runner.run(cfg)
    with stop_request(cfg.launcher.preempt_timeout_s):
        return runner.run(cfg)


def train_one_world(cfg: Config) -> dict:
    """The Trainer's run: join the world, train, leave."""
    import torch.distributed as dist  # torch: off the path of a refused command line

    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    join_world(cfg.launcher.device)
    trainer = Trainer(cfg, build_plugins(cfg.plugins, cfg))
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
        dist.destroy_process_group()


def run_from_overrides(overrides: Sequence[str]) -> Optional[dict]:
    return run(compose_config(overrides))


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Optional[dict]:
    return _run_or_exit(to_object(cfg))


def _run_or_exit(cfg: Config) -> Optional[dict]:
    """`run`, with a refused config, an aborted or a failed launch as one line and an exit code."""
    try:
        return exit_on_fault(run(cfg))
    except ConfigError as e:
        _fail(str(e))
    except LaunchRefused as e:  # a worker's ConfigError: bad input only the ranks could read
        print(f"launcher: rank {e.rank} refused its input; the workers stopped", file=sys.stderr)
        _fail(str(e))
    except LaunchAborted as e:  # a second pre-emption signal, or the deadline
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except LaunchFailed as e:  # one line; the workers' tracebacks are in the log file it names
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def exit_on_fault(summary: Optional[dict]) -> Optional[dict]:
    """`summary`, unless a non-finite or diverging step stopped the run (train.nan_policy): then
    its one line and exit code 1."""
    if summary and summary.get("fault"):
        print(f"error: {summary['fault']}", file=sys.stderr)
        sys.exit(1)
    return summary


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-m" in argv or "--multirun" in argv:
        owned = multirun_of_a_plugin(argv)
        if owned is not None:
            cfg, run_all = owned
            try:
                preflight(cfg)
                with holding_the_save_dir(cfg):
                    run_all()
            except (ConfigError, ValueError) as e:  # refused before training
                _fail(_first_line(e))
            return
    if any(a.startswith("-") for a in argv):
        _check_overrides_of_hydra_run(argv)
        sys.argv = [sys.argv[0], *argv]
        _hydra_main()
        return
    try:
        cfg = compose_config(argv)
    except Exception as e:  # Hydra/OmegaConf: unknown key, wrong type, missing preset
        _fail(_first_line(e))
    _run_or_exit(cfg)


def multirun_of_a_plugin(argv: list[str]) -> Optional[tuple[Config, Callable[[], Any]]]:
    """A multirun that a plugin its first run lists runs as one run of its own
    (`Plugin.multirun`), or None for Hydra."""
    try:
        sweep = read_sweep(argv)
        if sweep.hydra_options:
            return None
        first = compose_config(sweep.combinations[0])
        for plugin in plugin_classes(first.plugins):
            owned = plugin.multirun(sweep, first)
            if owned is not None:
                return owned
    except Exception as e:  # Hydra/OmegaConf or a plugin's rules: an unknown key, a bad value
        _fail(_first_line(e))
    return None


def _check_overrides_of_hydra_run(argv: list[str]) -> None:
    """The overrides of a run with Hydra's flags (`--cfg job`, ...), refused as a plain run's
    are: Hydra's own message for an unknown key advises `+key=`, which adds a key the schema
    does not have. Multiruns and other primary configs are left to Hydra."""
    args, _ = get_args_parser().parse_known_args(argv)
    if args.multirun or args.config_name or args.config_path or args.config_dir:
        return
    try:
        compose_config(args.overrides)
    except Exception as e:  # Hydra/OmegaConf: unknown key, wrong type, missing preset
        _fail(_first_line(e))


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split("\n")[:2])


if __name__ == "__main__":
    main()
