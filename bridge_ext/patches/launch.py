"""Launch patches: NeMo-Run's Slurm script.

* ``slurm-without-container`` (scope ``launch``, applied by ``bridge_ext.launch``): NeMo-Run 0.8.0's
  ``SlurmBatchRequest.materialize`` (``nemo_run/core/execution/slurm.py``, its nested ``get_container_flags``)
  gives every ``srun`` pyxis's ``--container-mounts`` and ``--container-workdir`` even when the executor has no
  ``container_image``; a cluster without pyxis refuses them (``srun: unrecognized option``). NeMo-Run 0.9.0
  (NVIDIA-NeMo/Run PR 409) writes ``--chdir <job dir>/code`` instead there. Where the installed function still
  writes the flags, the script it returns for an executor without an image gets 0.9.0's flags: the mounts'
  ``SRC:/nemo_run`` entry names the job directory whose ``code`` becomes the working directory.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any

from bridge_ext.upstream_patch import Patch

__all__ = ["PATCHES", "without_container_flags"]

_SLURM = "nemo_run.core.execution.slurm"
_FLAGS = re.compile(r" --container-mounts (?P<mounts>\S+) --container-workdir \S+(?: --container-env \S+)?")


def without_container_flags(script: str) -> str:
    """``script`` with each srun's pyxis flags replaced by ``--chdir <the /nemo_run mount's source>/code``."""

    def chdir(match: re.Match) -> str:
        sources = [m.split(":")[0] for m in match["mounts"].split(",") if m.split(":")[1:2] == ["/nemo_run"]]
        return f" --chdir {sources[-1]}/code" if sources else ""

    return _FLAGS.sub(chdir, script)


def _adds_mounts_without_image() -> bool:
    source = inspect.getsource(importlib.import_module(_SLURM).SlurmBatchRequest.materialize)
    return "if container_image is None" not in source


def _materialize_without_image(materialize: Any) -> Any:
    @functools.wraps(materialize)
    def patched(self: Any) -> str:
        script = materialize(self)
        return script if self.executor.container_image else without_container_flags(script)

    return patched


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="slurm-without-container", area="launch", scope="launch",
        module=_SLURM, attr="SlurmBatchRequest.materialize",
        upstream="nemo_run/core/execution/slurm.py SlurmBatchRequest.materialize: get_container_flags adds "
                 "--container-mounts/--container-workdir without a container_image (NeMo-Run 0.8; 0.9: --chdir)",
        why="a cluster without pyxis refuses those srun flags: `--container-image none` could not run",
        when="the installed materialize lacks NeMo-Run 0.9's `if container_image is None` branch",
        needed=_adds_mounts_without_image,
        snippets=('new_mounts.append(f"{src_job_dir}:/{RUNDIR_NAME}")', '"--container-workdir",'),
        make=_materialize_without_image,
    ),
)
