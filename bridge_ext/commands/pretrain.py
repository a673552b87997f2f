"""``nemo llm pretrain --recipe NAME``: validate (``--dryrun``), write (``--to-yaml``), train, or launch
through NeMo-Run (``--executor local|slurm``, ``bridge_ext.launch``). Precedence: recipe < --yaml < key=value."""

from __future__ import annotations

import argparse
from typing import Any

from bridge_ext.commands.common import add_training_arguments, resolve, select_recipe, show_or_write
from bridge_ext.errors import UserError
from bridge_ext.launch import CONTAINER_IMAGE, EXECUTORS
from bridge_ext.upstream_output import log_file, run_console

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="pre-train a recipe (--dryrun: validate and print the config)",
                              description="Precedence: recipe < --yaml < command-line key=value overrides.")
    p.add_argument("--recipe", help="a pre-training recipe (`nemo llm recipes`)")
    add_training_arguments(p, preset_help="another optimizer preset (default: the recipe's); or preset=NAME",
                           overrides_help="e.g. optimizer.lr=2e-4")
    p.add_argument("--verbose", action="store_true",
                   help="a run shows everything Megatron and its libraries print (default: our lines and Megatron's "
                        "iteration lines; the rest goes to upstream.log next to the checkpoints)")
    p.add_argument("--data", choices=("auto", "text", "mock"), default="auto",
                   help="auto: proxy recipes train on the standard-library text corpus (`nemo llm prepare-data`), "
                        "other recipes on mock data unless dataset.blend is set")
    g = p.add_argument_group("launch through NeMo-Run (--executor)")
    g.add_argument("--executor", choices=EXECUTORS, help="local: torchrun on this machine; slurm: sbatch via "
                   "NeMo-Run's SlurmExecutor (--dryrun prints the script)")
    g.add_argument("--nodes", type=int, help="slurm: nodes (default: the layout's GPUs / --gpus-per-node)")
    g.add_argument("--gpus-per-node", type=int, help="slurm: GPUs per node (default 4 for GB300 layouts: an NVL72 "
                   "compute tray; else 8)")
    g.add_argument("--account", help="slurm: the account to charge (required)")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", default="04:00:00", help="slurm: time limit (a run saves and exits 0 on SIGTERM)")
    g.add_argument("--stop-before", type=int, metavar="SECONDS",
                   help="slurm: Slurm sends SIGTERM this long before --time runs out (up to 60 s earlier); the run "
                        "finishes its iteration, saves and exits 0 (default 300, or a tenth of --time if shorter)")
    g.add_argument("--requeue", action="store_true",
                   help="slurm: a run stopped on SIGTERM (time limit, preemption, scancel --signal=TERM) requeues "
                        "its job, which resumes from the save (default: the job ends; the same command resumes)")
    g.add_argument("--container-image", default=CONTAINER_IMAGE,
                   help=f"slurm: image (default {CONTAINER_IMAGE}); none: no container, this Python environment")
    g.add_argument("--container-mounts", default="", help="slurm: comma-separated SRC:DST mounts (data, checkpoints)")
    g.add_argument("--job-dir", help="where NeMo-Run keeps the job (configs, logs, code): a path the nodes see; "
                   "default nemo_experiments/nemo_run")
    g.add_argument("--packager", choices=("git", "none"), default="git",
                   help="slurm: ship this checkout's HEAD (git archive) or nothing (the image has the package)")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable")
    g.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                   help="slurm: extra #SBATCH option, e.g. segment=16")
    return p


def run(args: argparse.Namespace) -> int:
    from recipes import get_recipe

    if args.executor:
        return _launch(args, get_recipe)
    if args.dryrun or args.to_yaml:
        show_or_write(resolve(args, get=get_recipe), args)
        return 0
    from bridge_ext.kill_safe import held_exit_signal
    from bridge_ext.slurm import adopt_slurm_ranks, note_stopped_run

    adopt_slurm_ranks()
    # a SIGTERM before training starts (Slurm's time limit, a preemption) stops the run after one iteration;
    # the console: our lines and Megatron's progress; upstream's setup lines and known warnings in a log file
    with held_exit_signal(), run_console(verbose=args.verbose, device=args.device) as console:
        from bridge_ext.training import train

        resolved = resolve(args, get=get_recipe)
        if console is not None:
            console.log_to(log_file(resolved.cfg.checkpoint.save or f"nemo_experiments/{resolved.recipe.name}"))
        stopped = train(resolved.recipe, resolved.cfg, device=args.device, data=args.data, checksums=args.checksums,
                        init=args.init)
    if stopped in ("signal", "time limit"):  # a Slurm job's cue to requeue (not a debugging exit interval)
        note_stopped_run()
    return 0


def _launch(args: argparse.Namespace, get_recipe: Any) -> int:
    """``--executor``: what was validated here runs on every rank (``bridge_ext.launch``)."""
    from bridge_ext.launch import LaunchOptions, check_launch, launch

    recipe = select_recipe(args, get_recipe)
    if args.to_yaml:
        raise UserError("--executor launches a run; write the YAML with --to-yaml alone")
    options = LaunchOptions(
        executor=args.executor, nodes=args.nodes, gpus_per_node=args.gpus_per_node, account=args.account,
        partition=args.partition, time=args.time, container_image=args.container_image,
        container_mounts=args.container_mounts, job_dir=args.job_dir, packager=args.packager, env=args.env,
        sbatch=args.sbatch, device=args.device, data=args.data, dryrun=args.dryrun, stop_before=args.stop_before,
        requeue=args.requeue, checksums=args.checksums, init=args.init)
    chosen = recipe.layout(args.layout)
    nodes, per_node = check_launch(options, gpus=chosen.gpus, cluster=chosen.cluster)
    resolved = resolve(args, get=get_recipe)
    from bridge_ext.overrides import config_to_yaml

    return launch(options, recipe=resolved.recipe, layout=resolved.layout.cluster,
                  config_yaml=config_to_yaml(resolved.cfg), nodes=nodes, per_node=per_node,
                  save_dir=resolved.cfg.checkpoint.save)
