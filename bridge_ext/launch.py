"""``nemo llm pretrain --recipe NAME --executor local|slurm``: launch through NeMo-Run.

NeMo-Run's own executors and launcher do the work (``nemo_run.LocalExecutor`` / ``nemo_run.SlurmExecutor``
with ``launcher="torchrun"``, in an ``Experiment``); nothing here writes an sbatch script or a torchrun line.
What runs is what was validated: the config is resolved and checked for the layout's GPU count in this
process (as ``--dryrun`` does), written as the YAML ``--to-yaml`` writes to ``JOB_DIR/configs/NAME-TIME.yaml``
(mounted read-only at ``/nemo_run_configs`` in a Slurm container), and every rank starts
``python -m bridge_ext.commands llm pretrain --recipe NAME --layout L --preset P --yaml THAT_FILE``.

- ``local``: torchrun with the layout's process count on this machine (1 node); on a machine without GPUs
  the proxies' multi-process layouts (``cpu-dp2``, ``cpu-tp2``, ...) train on CPU with gloo.
- ``slurm``: ``--nodes`` x ``--gpus-per-node`` must equal the layout's GPUs (default: 4 GPUs per node for GB300
  layouts, the NVL72 compute tray; 8 otherwise), ``--account`` is required; container image (default the
  NeMo 26.02 image; ``none``: the current Python environment, for clusters without pyxis/enroot), mounts,
  time, partition and the environment Megatron needs (:data:`MEGATRON_ENV`). ``srun`` starts one process per
  rank (NeMo-Run's launcher ``None``; ranks from ``SLURM_PROCID``, ``bridge_ext.slurm``): Slurm's signals reach
  every rank directly, not a torchrun agent that would kill its workers 30 s after its own SIGTERM. The job
  asks for SIGTERM ``--stop-before`` seconds before its time limit; the run saves and exits 0, and with
  ``--requeue`` the job requeues itself and resumes. The code travels as NeMo-Run's ``GitArchivePackager``
  makes it (``git archive`` of this checkout's HEAD, unpacked at ``/nemo_run/code``, the working directory),
  or not at all with ``--packager none`` (an image, mount or environment that has the package installed).
  The job's script, logs and code live under ``JOB_DIR/experiments/`` (NeMo-Run's home is the job
  directory, so the script it writes is the one it submits). ``--dryrun`` prints the sbatch script NeMo-Run
  generates and submits nothing. Before anything is written, ``sbatch --test-only`` asks the scheduler
  whether it accepts the request (``bridge_ext.slurm.preflight``).

Bad input (a node count that does not hold the layout, a missing account, what the Slurm scheduler refuses)
is a ``UserError`` from :func:`check_launch`, before anything is built or written. The options are
``nemo llm pretrain``'s (``bridge_ext.commands.pretrain``), as a :class:`LaunchOptions`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.runtime import write_atomic
from recipes.selection import key_value

__all__ = ["CONTAINER_IMAGE", "EXECUTORS", "MEGATRON_ENV", "LaunchOptions", "check_launch", "container",
           "gpus_per_node", "job_directory", "launch", "sbatch_options", "stop_seconds", "uses_gpus"]

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


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to launch (``nemo llm pretrain --executor ...``; defaults as its options')."""

    executor: Executor
    nodes: int | None = None  # slurm: default the layout's GPUs / gpus_per_node
    gpus_per_node: int | None = None  # default 4 for GB200/GB300 layouts (an NVL72 compute tray), else 8
    account: str | None = None  # slurm: required
    partition: str | None = None
    time: str = "04:00:00"
    stop_before: int | None = None  # slurm: SIGTERM this long before the time limit (default: stop_seconds)
    requeue: bool = False  # slurm: a run stopped on SIGTERM requeues its job, which resumes from the save
    container_image: str = CONTAINER_IMAGE  # "none": no container, the current Python environment
    container_mounts: str = ""  # comma-separated SRC:DST
    job_dir: str | None = None  # default nemo_experiments/nemo_run
    packager: Literal["git", "none"] = "git"
    env: list[str] = field(default_factory=list)  # KEY=VALUE
    sbatch: list[str] = field(default_factory=list)  # KEY=VALUE, extra #SBATCH options
    device: Literal["auto", "gpu", "cpu"] = "auto"  # passed on to every rank
    checksums: bool = True  # False: --no-checksums, passed on to every rank
    init: Literal["by-name", "upstream"] = "by-name"  # --init, passed on to every rank
    data: Literal["auto", "text", "mock"] = "auto"
    dryrun: bool = False  # print NeMo-Run's script or torchrun command; submit and write nothing


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
        pair = key_value(item)
        if pair is None:
            raise UserError(f"{what} '{item}' is not KEY=VALUE")
        out[pair[0]] = pair[1]
    return out


def uses_gpus(options: LaunchOptions, cluster: str) -> bool:
    """Whether the ranks run on GPUs (the proxies' ``cpu*`` layouts and ``--device cpu`` do not)."""
    return not cluster.startswith("cpu") and options.device != "cpu"


def container(options: LaunchOptions) -> str | None:
    """The Slurm container image, or None (``--container-image none``)."""
    return None if options.container_image.lower() == "none" else options.container_image


def stop_seconds(options: LaunchOptions) -> int:
    """Seconds before the Slurm time limit that the job asks for SIGTERM: ``--stop-before``, else 300 (a large
    model's save) or a tenth of ``--time`` where that is shorter."""
    from bridge_ext.slurm import parse_time

    return options.stop_before or min(300, parse_time(options.time) // 10)


def check_launch(options: LaunchOptions, *, gpus: int, cluster: str) -> tuple[int, int]:
    """(nodes, processes per node) for a layout of ``gpus`` on ``cluster``; ``UserError`` for what cannot run it."""
    if options.executor == "local":
        if (options.nodes or 1) != 1:
            raise UserError(f"--executor local runs on this machine (1 node), got --nodes {options.nodes}; use slurm")
        per_node = options.gpus_per_node or gpus
        if per_node != gpus:
            raise UserError(f"layout {cluster} needs {gpus} processes, --gpus-per-node says {per_node}")
        here = _local_gpus()
        if uses_gpus(options, cluster) and here < gpus:
            raise UserError(f"layout {cluster} needs {gpus} processes with a GPU each; this machine has {here} GPUs "
                            "(use --executor slurm, a cpu-* layout, or --device cpu)")
        nodes, per_node = 1, gpus
    else:
        nodes, per_node = _slurm_shape(options, gpus, cluster)
    _pairs(options.env, "--env"), _pairs(options.sbatch, "--sbatch")  # bad pairs fail before the slow part
    if options.executor == "slurm" and not options.dryrun:  # the scheduler's answer before anything is built
        from bridge_ext.slurm import preflight

        preflight(job_dir=job_directory(options), sbatch_options=sbatch_options(
            options, nodes=nodes, per_node=per_node, gpus=uses_gpus(options, cluster)))
    return nodes, per_node


def job_directory(options: LaunchOptions) -> Path:
    return Path(options.job_dir or "nemo_experiments/nemo_run").resolve()


def _slurm_shape(options: LaunchOptions, gpus: int, cluster: str) -> tuple[int, int]:
    if not options.account:
        raise UserError("--executor slurm needs --account (the Slurm account to charge)")
    from bridge_ext.slurm import parse_time

    limit = parse_time(options.time)
    if options.stop_before is not None and not 0 < options.stop_before < limit:
        raise UserError(f"--stop-before {options.stop_before} s must be above 0 and below --time {options.time} "
                        f"({limit} s): the run stops that long before the limit to save")
    if container(options) is None and options.container_mounts:
        raise UserError("--container-mounts needs a container image (--container-image none runs without one)")
    if options.gpus_per_node is None and options.nodes and gpus % options.nodes == 0:
        per_node = gpus // options.nodes  # --nodes alone: the layout's GPUs spread evenly
    else:
        per_node = options.gpus_per_node or min(gpus_per_node(cluster), gpus)
    nodes = options.nodes or -(-gpus // per_node)
    if nodes < 1 or per_node < 1 or nodes * per_node != gpus:
        raise UserError(f"layout {cluster} needs {gpus} GPUs; --nodes {nodes} x --gpus-per-node {per_node} = "
                        f"{nodes * per_node}: pick nodes x GPUs per node = {gpus}, or another layout")
    return nodes, per_node


def _task_args(options: LaunchOptions, recipe: Any, layout: str, config: str) -> list[str]:
    out = ["llm", "pretrain", "--recipe", recipe.name, "--layout", layout, "--preset", recipe.preset.name,
           "--yaml", config]
    if options.device != "auto":
        out += ["--device", options.device]
    if options.data != "auto":
        out += ["--data", options.data]
    if not options.checksums:
        out.append("--no-checksums")
    if options.init != "by-name":
        out += ["--init", options.init]
    return out


def _executor(options: LaunchOptions, nodes: int, per_node: int, job_dir: Path, home: Path, gpus: bool) -> Any:
    import nemo_run as run

    env = {**_pairs(options.env, "--env")}
    if options.executor == "local":
        # the checkout on the path even where the package is not installed; rank processes start in the job dir
        env.setdefault("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
        # torchrun and python of this interpreter's environment, activated or not
        env.setdefault("PATH", os.pathsep.join(filter(None, (str(Path(sys.executable).parent), os.environ.get("PATH")))))
        return run.LocalExecutor(ntasks_per_node=per_node, launcher="torchrun", env_vars=env)
    from bridge_ext.slurm import RANKS_FROM, setup_lines

    mounts = [m for m in options.container_mounts.split(",") if m]
    for mount in mounts:
        if ":" not in mount:
            raise UserError(f"--container-mounts entry '{mount}' is not SRC:DST")
    packager = run.GitArchivePackager(basepath=str(ROOT)) if options.packager == "git" else run.Packager()
    # NeMo-Run's home is the job directory (launch()): its LocalTunnel then submits the script NeMo-Run wrote
    return run.SlurmExecutor(
        account=options.account, partition=options.partition, nodes=nodes, ntasks_per_node=per_node,
        gpus_per_node=per_node if gpus else None, time=options.time, container_image=container(options),
        container_mounts=mounts, env_vars={**MEGATRON_ENV, RANKS_FROM: "slurm", **env},
        tunnel=run.LocalTunnel(job_dir=str(home / "experiments")), packager=packager,
        signal=f"TERM@{stop_seconds(options)}",
        setup_lines=setup_lines(requeue_dir=job_dir if options.requeue else None),
        additional_parameters=_pairs(options.sbatch, "--sbatch") or None)


def sbatch_options(options: LaunchOptions, *, nodes: int, per_node: int, gpus: bool) -> list[str]:
    """The resource request as ``sbatch`` options (what :func:`bridge_ext.slurm.preflight` asks Slurm about)."""
    out = [f"--account={options.account}", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
           f"--time={options.time}"]
    out += [f"--partition={options.partition}"] if options.partition else []
    out += [f"--gpus-per-node={per_node}"] if gpus else []
    return out + [f"--{key}={value}" for key, value in _pairs(options.sbatch, "--sbatch").items()]


def launch(options: LaunchOptions, *, recipe: Any, layout: str, config_yaml: str, nodes: int, per_node: int,
           save_dir: str | None = None) -> int:
    """Run (or, ``options.dryrun``, show) ``recipe`` on ``layout`` through NeMo-Run with ``config_yaml``, the
    resolved and validated config; ``nodes`` x ``per_node`` from :func:`check_launch`; ``save_dir``: the run's
    ``checkpoint.save`` (said where the job's results land). Returns the exit code."""
    import tempfile
    import time

    job_dir = job_directory(options)
    slurm = options.executor == "slurm"
    gpus = uses_gpus(options, layout)
    # The config travels as a file in the job directory (a path the nodes see), mounted read-only in a container.
    configs = job_dir / "configs"
    config_file = configs / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.yaml"
    in_container = slurm and container(options) is not None
    config = f"{CONFIG_MOUNT}/{config_file.name}" if in_container else str(config_file)
    # NeMo-Run keeps an experiment's metadata, script and logs in its home: the job directory (a dry run: a
    # temporary one, removed after; it leaves nothing behind)
    home = Path(tempfile.mkdtemp(prefix="nemo_run_dryrun_")) if options.dryrun else job_dir
    from rich.console import Console

    with Console(stderr=True).status("NeMo-Run: preparing the job ..."):
        import nemo_run as run

        from bridge_ext.upstream_patch import apply

        apply("launch")
        executor = _executor(options, nodes, per_node, job_dir, home, gpus)
    if in_container:
        executor.container_mounts.append(f"{configs}:{CONFIG_MOUNT}:ro")
        if options.requeue:  # rank 0 leaves the requeue file there: the same path inside as the job script sees
            executor.container_mounts.append(f"{job_dir}:{job_dir}")
    # without a container the ranks run this environment's Python (its bin/ need not be on the nodes' PATH)
    entrypoint = "python" if in_container or not slurm else sys.executable
    task = run.Script(path="bridge_ext.commands", m=True, entrypoint=entrypoint,
                      args=_task_args(options, recipe, layout, config))
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    previous_home = get_nemorun_home()
    set_nemorun_home(str(home))
    if not options.dryrun:
        configs.mkdir(parents=True, exist_ok=True)
        _write_new(config_file, config_yaml)
        print(f"config: {config_file} (the resolved, validated YAML; `--to-yaml` writes the same)", file=sys.stderr)
    state, script, local, submitted = None, None, None, None
    import contextlib

    # NeMo-Run's console reports on stdout; a dry run's stdout is the script alone
    quiet = contextlib.redirect_stdout(sys.stderr) if options.dryrun else contextlib.nullcontext()
    try:
        with quiet, run.Experiment(recipe.name, executor=executor, log_level="WARN") as exp:
            exp.add(task, name=recipe.name, tail_logs=not slurm and not options.dryrun)
            job = exp.jobs[0]
            if options.dryrun:
                exp.dryrun(log=False)
                script = _dryrun_text(job, options.executor)
            elif slurm:  # submit and return: Slurm runs it
                _submit(exp)
                submitted = job
            else:
                exp.run(sequential=True, detach=False, tail_logs=True)
                local = job  # the experiment waits for it when the block ends
        if local is not None:
            state = local.state  # what torchx reported when the processes ended (Experiment.status: UNKNOWN locally)
    finally:
        set_nemorun_home(previous_home)
        if options.dryrun:
            import shutil

            shutil.rmtree(home, ignore_errors=True)
    if script is not None:
        print(script, end="")
        return 0
    if submitted is not None:
        _say_submitted(submitted, save_dir=save_dir, requeue=options.requeue)
        return 0
    return _exit_code(state)


def _submit(exp: Any) -> None:
    """``exp.run(detach=True)``; sbatch's refusal (the request changed since the preflight) as one line."""
    from invoke.exceptions import UnexpectedExit

    from bridge_ext.slurm import scheduler_reason

    try:
        exp.run(detach=True)
    except UnexpectedExit as exc:
        raise UserError(f"Slurm refused the job: {scheduler_reason(exc.result.stderr)}") from None


def _say_submitted(job: Any, *, save_dir: str | None, requeue: bool) -> None:
    """The job id, how to follow it, and where its logs, checkpoints and losses land."""
    job_id = str(job.handle).rstrip("/").rsplit("/", 1)[-1]
    logs = Path(job.executor.job_dir)
    lines = [f"submitted Slurm job {job_id}",
             f"  follow:      squeue -j {job_id}   (logs: tail -f {logs}/log-*{job_id}*.out)",
             f"  stop:        scancel --signal=TERM {job_id}   (saves, exits 0{'; requeued' if requeue else ''})",
             f"  job files:   {logs}"]
    if save_dir:
        lines += [f"  checkpoints: {save_dir}", f"  losses:      {Path(save_dir) / 'losses.jsonl'} (CPU runs)"]
    print("\n".join(lines))


def _write_new(path: Path, text: str) -> None:
    if path.exists():
        raise UserError(f"{path} exists; launch again (the name carries the time to the second)")
    write_atomic(path, text)


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
