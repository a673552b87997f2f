"""``nemo llm pretrain --recipe NAME --executor local|slurm``: launch through NeMo-Run.

NeMo-Run's own executors and launcher do the work (``nemo_run.LocalExecutor`` / ``nemo_run.SlurmExecutor``
with ``launcher="torchrun"``, in an ``Experiment``); nothing here writes an sbatch script or a torchrun line.
What runs is what was validated: the config is resolved and checked for the layout's GPU count in this
process (as ``--dryrun`` does), written as the YAML ``--to-yaml`` writes to ``JOB_DIR/configs/NAME-TIME.yaml``
(mounted read-only at ``/nemo_run_configs`` in a Slurm container), and every rank starts
``python -m bridge_ext.cli llm pretrain --recipe NAME --layout L --preset P --yaml THAT_FILE``.

- ``local``: torchrun with the layout's process count on this machine (1 node); on a machine without GPUs
  the proxies' multi-process layouts (``cpu-dp2``, ``cpu-tp2``, ...) train on CPU with gloo.
- ``slurm``: ``--nodes`` x ``--gpus-per-node`` must equal the layout's GPUs (default: 4 GPUs per node for GB300
  layouts, the NVL72 compute tray; 8 otherwise), ``--account`` is required; container image (default the
  NeMo 26.02 image), mounts, time, partition and the environment Megatron needs (:data:`MEGATRON_ENV`). The
  code travels as NeMo-Run's ``GitArchivePackager`` makes it (``git archive`` of this checkout's HEAD,
  unpacked at ``/nemo_run/code``, the container's working directory), or not at all with ``--packager none``
  (an image or mount that has the package installed). ``--dryrun`` prints the sbatch script NeMo-Run
  generates and submits nothing.

Bad input (unknown executor, a node count that does not hold the layout, a missing account) is a
``UserError`` before anything is built or written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Literal

from bridge_ext.errors import UserError

__all__ = ["CONTAINER_IMAGE", "EXECUTORS", "MEGATRON_ENV", "add_launch_arguments", "gpus_per_node", "launch"]

Executor = Literal["local", "slurm"]
EXECUTORS: tuple[Executor, ...] = ("local", "slurm")
CONTAINER_IMAGE = "nvcr.io/nvidia/nemo:26.02"  # the stack this package is pinned to (docs/stacks.md)
CONFIG_MOUNT = "/nemo_run_configs"  # where a Slurm job sees --job-dir/configs
ROOT = Path(__file__).resolve().parent.parent

# Environment for Megatron on GPUs (as NeMo's and Megatron Bridge's launch scripts set it):
MEGATRON_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # TP/SP communication ordered before compute (megatron-core's overlap)
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",  # frees NCCL buffers without recordStream (lower peak memory)
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP off: its buffers cost memory, Megatron does not need it
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",  # never download at run time (configs ship with the package)
    "TRANSFORMERS_OFFLINE": "1",
}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--executor`` options of ``nemo llm pretrain``."""
    g = parser.add_argument_group("launch through NeMo-Run (--executor)")
    g.add_argument("--executor", choices=EXECUTORS, help="local: torchrun on this machine; slurm: sbatch via "
                   "NeMo-Run's SlurmExecutor (--dryrun prints the script)")
    g.add_argument("--nodes", type=int, help="slurm: nodes (default: the layout's GPUs / --gpus-per-node)")
    g.add_argument("--gpus-per-node", type=int, help="slurm: GPUs per node (default 4 for GB300 layouts: an NVL72 "
                   "compute tray; else 8)")
    g.add_argument("--account", help="slurm: the account to charge (required)")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", default="04:00:00", help="slurm: time limit (a run saves and exits 0 on SIGTERM)")
    g.add_argument("--container-image", default=CONTAINER_IMAGE, help=f"slurm: image (default {CONTAINER_IMAGE})")
    g.add_argument("--container-mounts", default="", help="slurm: comma-separated SRC:DST mounts (data, checkpoints)")
    g.add_argument("--job-dir", help="where NeMo-Run keeps the job (configs, logs, code): a path the nodes see; "
                   "default nemo_experiments/nemo_run")
    g.add_argument("--packager", choices=("git", "none"), default="git",
                   help="slurm: ship this checkout's HEAD (git archive) or nothing (the image has the package)")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable")
    g.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                   help="slurm: extra #SBATCH option, e.g. segment=16")


def gpus_per_node(cluster: str) -> int:
    """GPUs in one Slurm node of the layout's cluster: GB200/GB300 NVL72 trays hold 4, HGX boards 8."""
    return 4 if cluster.startswith(("gb200", "gb300")) else 8


def _local_gpus() -> int:
    """GPUs on this machine (``nvidia-smi -L``; ``CUDA_VISIBLE_DEVICES`` narrows them), without importing torch."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(listed, len([d for d in visible.split(",") if d.strip()])) if visible is not None else listed


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"{what} '{item}' is not KEY=VALUE")
        out[key] = value
    return out


def _check(args: argparse.Namespace, gpus: int, cluster: str) -> tuple[int, int]:
    """(nodes, processes per node) for the layout; ``UserError`` for what cannot run it."""
    if args.to_yaml:
        raise UserError("--executor launches a run; write the YAML with --to-yaml alone")
    if args.executor == "local":
        if (args.nodes or 1) != 1:
            raise UserError(f"--executor local runs on this machine (1 node), got --nodes {args.nodes}; use slurm")
        per_node = args.gpus_per_node or gpus
        if per_node != gpus:
            raise UserError(f"layout {cluster} needs {gpus} processes, --gpus-per-node says {per_node}")
        here = _local_gpus()
        if not cluster.startswith("cpu") and args.device != "cpu" and here < gpus:
            raise UserError(f"layout {cluster} needs {gpus} processes with a GPU each; this machine has {here} GPUs "
                            "(use --executor slurm, a cpu-* layout, or --device cpu)")
        return 1, gpus
    if not args.account:
        raise UserError("--executor slurm needs --account (the Slurm account to charge)")
    per_node = args.gpus_per_node or min(gpus_per_node(cluster), gpus)
    nodes = args.nodes or -(-gpus // per_node)
    if nodes < 1 or per_node < 1 or nodes * per_node != gpus:
        raise UserError(f"layout {cluster} needs {gpus} GPUs; --nodes {nodes} x --gpus-per-node {per_node} = "
                        f"{nodes * per_node}: pick nodes x GPUs per node = {gpus}, or another layout")
    return nodes, per_node


def _task_args(args: argparse.Namespace, recipe: Any, layout: str, config: str) -> list[str]:
    out = ["llm", "pretrain", "--recipe", recipe.name, "--layout", layout, "--preset", recipe.preset.name,
           "--yaml", config]
    if args.device != "auto":
        out += ["--device", args.device]
    if args.data != "auto":
        out += ["--data", args.data]
    return out


def _executor(args: argparse.Namespace, nodes: int, per_node: int, job_dir: Path) -> Any:
    import nemo_run as run

    env = {**_pairs(args.env, "--env")}
    if args.executor == "local":
        # the checkout on the path even where the package is not installed; rank processes start in the job dir
        env.setdefault("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
        # torchrun and python of this interpreter's environment, activated or not
        env.setdefault("PATH", os.pathsep.join(filter(None, (str(Path(sys.executable).parent), os.environ.get("PATH")))))
        return run.LocalExecutor(ntasks_per_node=per_node, launcher="torchrun", env_vars=env)
    mounts = [m for m in args.container_mounts.split(",") if m]
    for mount in mounts:
        if ":" not in mount:
            raise UserError(f"--container-mounts entry '{mount}' is not SRC:DST")
    packager = run.GitArchivePackager(basepath=str(ROOT)) if args.packager == "git" else run.Packager()
    executor = run.SlurmExecutor(
        account=args.account, partition=args.partition, nodes=nodes, ntasks_per_node=per_node,
        gpus_per_node=per_node, time=args.time, container_image=args.container_image, container_mounts=mounts,
        env_vars={**MEGATRON_ENV, **env}, tunnel=run.LocalTunnel(job_dir=str(job_dir)), packager=packager,
        additional_parameters=_pairs(args.sbatch, "--sbatch") or None)
    executor.launcher = "torchrun"
    return executor


def launch(args: argparse.Namespace, *, resolve: Callable[[argparse.Namespace], tuple]) -> int:
    """Resolve and validate the recipe (``resolve``: the CLI's), then run or (``--dryrun``) show it via NeMo-Run."""
    from recipes import get_recipe

    recipe = get_recipe(args.recipe)
    chosen = (recipe.with_preset(args.preset) if args.preset else recipe).layout(args.layout)
    nodes, per_node = _check(args, chosen.gpus, chosen.cluster)
    _pairs(args.env, "--env"), _pairs(args.sbatch, "--sbatch")  # bad pairs fail before the slow part
    job_dir = Path(args.job_dir or "nemo_experiments/nemo_run").resolve()
    recipe, layout, cfg, _checked = resolve(args)
    from bridge_ext.overrides import config_to_yaml

    resolved = config_to_yaml(cfg)
    # The config travels as a file in the job directory (a path the nodes see), mounted read-only on Slurm.
    import time

    configs = job_dir / "configs"
    config_file = configs / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.yaml"
    config = f"{CONFIG_MOUNT}/{config_file.name}" if args.executor == "slurm" else str(config_file)
    from rich.console import Console

    with Console(stderr=True).status("NeMo-Run: preparing the job ..."):
        import nemo_run as run

        executor = _executor(args, nodes, per_node, job_dir)
    if args.executor == "slurm":
        executor.container_mounts.append(f"{configs}:{CONFIG_MOUNT}:ro")
    task = run.Script(path="bridge_ext.cli", m=True, entrypoint="python",
                      args=_task_args(args, recipe, layout.cluster, config))
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    home, temporary = get_nemorun_home(), None
    if args.dryrun:  # NeMo-Run keeps experiment metadata in its home: a dry run leaves nothing behind
        import tempfile

        temporary = tempfile.mkdtemp(prefix="nemo_run_dryrun_")
        set_nemorun_home(temporary)
    else:
        configs.mkdir(parents=True, exist_ok=True)
        _write_new(config_file, resolved)
        print(f"config: {config_file} (the resolved, validated YAML; `--to-yaml` writes the same)", file=sys.stderr)
        if args.executor == "local":  # the local run's logs next to its config
            set_nemorun_home(str(job_dir))
    state, script, local = None, None, None
    import contextlib

    # NeMo-Run's console reports on stdout; a dry run's stdout is the script alone
    quiet = contextlib.redirect_stdout(sys.stderr) if args.dryrun else contextlib.nullcontext()
    try:
        with quiet, run.Experiment(recipe.name, executor=executor, log_level="WARN") as exp:
            exp.add(task, name=recipe.name, tail_logs=args.executor == "local" and not args.dryrun)
            job = exp.jobs[0]
            if args.dryrun:
                exp.dryrun(log=False)
                script = _dryrun_text(job, args.executor)
            elif args.executor == "slurm":  # submit and return: Slurm runs it
                exp.run(detach=True)
            else:
                exp.run(sequential=True, detach=False, tail_logs=True)
                local = job  # the experiment waits for it when the block ends
        if local is not None:
            state = local.state  # what torchx reported when the processes ended (Experiment.status: UNKNOWN locally)
    finally:
        set_nemorun_home(home)
        if temporary:
            import shutil

            shutil.rmtree(temporary, ignore_errors=True)
    if script is not None:
        print(script, end="")
        return 0
    return _exit_code(state)


def _write_new(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    if path.exists():
        tmp.unlink()
        raise UserError(f"{path} exists; launch again (the name carries the time to the second)")
    tmp.replace(path)


def _dryrun_text(job: Any, executor: str) -> str:
    """The sbatch script NeMo-Run generated (Slurm), or the torchrun command it would run (local)."""
    if executor == "slurm":
        return job._dryrun_info.request.materialize()
    import shlex

    lines = ["# NeMo-Run LocalExecutor (torchrun launcher): the processes torchx would start"]
    for replicas in job._dryrun_info.request.role_params.values():
        for replica in replicas:
            lines.append(f"cd {shlex.quote(replica.cwd or '.')} && {shlex.join(replica.args)}")
    return "\n".join(lines) + "\n"


def _exit_code(state: Any) -> int:
    """0 when the local run succeeded (or a Slurm job was submitted), 1 otherwise."""
    if state is None:
        return 0
    name = getattr(state, "name", str(state))
    if name != "SUCCEEDED":
        print(f"error: the NeMo-Run job ended {name}", file=sys.stderr)
        return 1
    return 0
