"""Which iterations of a Megatron Bridge checkpoint directory are complete, and which one a run resumes from.

One answer for training (``bridge_ext.kill_safe.prepare_resume``) and for ``nemo llm export``
(:func:`find_iteration`), so export always picks the iteration a rerun of the training command would load.

Megatron Bridge resumes from the iteration its tracker names: ``latest_train_state.pt`` when it exists, else
Megatron-LM's ``latest_checkpointed_iteration.txt`` (``training/checkpointing.py``,
``_resolve_checkpoint_iteration``). Saves made through ``bridge_ext.kill_safe`` move the tracker only once
the iteration is complete and flushed; an iteration the tracker names but that lacks a file (a save made
without it, a copy cut short) makes the run fall back to the newest complete iteration before it.

The iteration chosen is vetted before anything loads it: every pickle in it (and the root's) names only
classes legitimate checkpoints hold (:mod:`~bridge_ext.checkpoints.pickles`), so a checkpoint from someone else
runs no code in export or resume.

Imports nothing heavy at module level (torch only to read ``latest_train_state.pt``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from bridge_ext.checkpoints.pickles import vet_checkpoint
from bridge_ext.errors import UserError
from bridge_ext.stack import common_state_inside_checkpoint

__all__ = [
    "TRACKER_PT",
    "TRACKER_TXT",
    "ResumePoint",
    "find_iteration",
    "is_complete",
    "iteration_dir",
    "iterations",
    "missing_files",
    "read_tracker",
    "resume_point",
]

TRACKER_PT = "latest_train_state.pt"  # Megatron Bridge's tracker, read first
TRACKER_TXT = "latest_checkpointed_iteration.txt"  # Megatron-LM's, read when the first is absent
_ITER_RE = re.compile(r"^iter_(\d{7,})$")

# torch_dist (Megatron's dist_checkpointing), in the order a save writes them: common.pt first, torch DCP's
# .metadata after every data file, metadata.json last (megatron/core/dist_checkpointing/serialization.py, save).
_TORCH_DIST_FILES = ("common.pt", ".metadata", "metadata.json")
# What a resume reads besides the weights: the iteration's counters (without train_state.pt, Megatron Bridge
# rebuilds them from the state dict) and run_config.yaml (without it the iteration is taken for a legacy
# Megatron-LM checkpoint and the load stops: "Legacy checkpoint missing 'args' field").
_RESUME_FILES = ("train_state.pt", "run_config.yaml")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"  # as training/utils/checkpoint_utils.py, get_checkpoint_name


def iterations(root: str | Path) -> dict[int, Path]:
    """Every ``iter_XXXXXXX`` directory under ``root``, complete or not, by number."""
    try:
        entries = list(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {int(m.group(1)): p for p in entries if (m := _ITER_RE.match(p.name)) and p.is_dir()}
    return dict(sorted(found.items()))


def missing_files(iter_dir: str | Path) -> list[str]:
    """The files a resume from ``iter_dir`` needs that are not there (empty: the iteration is complete)."""
    try:
        names = set(os.listdir(iter_dir))
    except (FileNotFoundError, NotADirectoryError):
        return ["the directory"]
    # ckpt_format fsdp_dtensor is plain torch DCP: .metadata without Megatron's common.pt and metadata.json
    dcp_only = ".metadata" in names and not names & {"common.pt", "metadata.json"}
    weights = (".metadata",) if dcp_only else _TORCH_DIST_FILES
    if "common.pt" not in names and common_state_inside_checkpoint():  # megatron-core 0.19 writes none
        weights = tuple(name for name in weights if name != "common.pt")
    return [name for name in (*weights, *_RESUME_FILES) if name not in names]


def is_complete(iter_dir: str | Path) -> bool:
    return not missing_files(iter_dir)


def read_tracker(root: str | Path) -> tuple[int | None, str | None]:
    """The iteration the tracker names, the way Megatron Bridge reads it, and a note when it could not read
    ``latest_train_state.pt`` and used the text tracker instead. ``(None, None)``: no tracker."""
    root = Path(root)
    note = None
    if (root / TRACKER_PT).is_file():
        try:
            import torch

            return int(torch.load(root / TRACKER_PT, map_location="cpu", weights_only=True)["step"]), None
        except Exception as exc:  # a tracker cut short by a save without bridge_ext.kill_safe
            note = f"{root / TRACKER_PT} is unreadable ({type(exc).__name__})"
    try:
        text = (root / TRACKER_TXT).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None, note
    return (int(text), note) if text.isdigit() else (None, note)  # "release" or garbage: nothing to resume


@dataclass(frozen=True)
class ResumePoint:
    iteration: int | None  # the iteration a run loads; None: nothing committed, a run starts from scratch
    tracker: int | None  # the iteration the tracker names
    note: str | None = None  # one line when the run does not load what the tracker names

    @property
    def overrides_tracker(self) -> bool:
        """Whether loading ``iteration`` needs telling Megatron Bridge (its own tracker reading would differ)."""
        return self.note is not None


def resume_point(root: str | Path) -> ResumePoint:
    """Where a run with ``checkpoint.load=root`` resumes: the tracker's iteration when it is complete, else
    the newest complete iteration before it. A ``UserError`` when the tracker names an iteration but no
    complete one exists (starting from scratch would overwrite what is there)."""
    root = Path(root)
    tracker, note = read_tracker(root)
    if tracker is None:
        if note:
            raise UserError(f"{note} and {root / TRACKER_TXT} is missing; remove both to start afresh")
        return ResumePoint(None, None)
    missing = missing_files(iteration_dir(root, tracker))
    if not missing:
        vet_checkpoint(iteration_dir(root, tracker), root)
        return ResumePoint(tracker, tracker, note)
    what = f"iteration {tracker} in {root} is incomplete (missing {', '.join(missing)})"
    older = [n for n, path in iterations(root).items() if n < tracker and is_complete(path)]
    if not older:
        raise UserError(f"{what} and no earlier iteration is complete; nothing to resume from (move {root} "
                        "away to start afresh)")
    vet_checkpoint(iteration_dir(root, older[-1]), root)
    return ResumePoint(older[-1], tracker, f"{what}; using iteration {older[-1]}, the newest complete one")


def find_iteration(ckpt: str | Path, iteration: int | None = None) -> tuple[Path, int]:
    """The iteration directory ``nemo llm export`` reads, and its number.

    ``ckpt`` is a checkpoint root (what training and ``import`` write) or one iteration directory. By default
    the iteration a training run resumes from (:func:`resume_point`); ``iteration`` picks another complete one.
    """
    ckpt = Path(ckpt)
    if not ckpt.exists():
        raise UserError(f"--ckpt {ckpt} does not exist")
    if not ckpt.is_dir():
        raise UserError(f"--ckpt {ckpt} is not a directory")
    match = _ITER_RE.match(ckpt.name)
    if match or (ckpt / ".metadata").is_file():  # one iteration directory
        number = int(match.group(1)) if match else 0
        if iteration is not None and iteration != number:
            raise UserError(f"--ckpt {ckpt} is iteration {number}, not {iteration}; pass the checkpoint root instead")
        missing = missing_files(ckpt)
        if missing:
            raise UserError(f"--ckpt {ckpt} is incomplete (missing {', '.join(missing)}); a save was interrupted")
        vet_checkpoint(ckpt, ckpt.parent)
        return ckpt, number
    found = iterations(ckpt)
    complete = [n for n, path in found.items() if is_complete(path)]
    if not found:
        raise UserError(f"--ckpt {ckpt} is not a Megatron checkpoint (no iter_XXXXXXX directories)")
    if iteration is not None:
        if iteration not in found:
            listed = ", ".join(str(n) for n in complete[-8:]) or "none complete"
            raise UserError(f"--iteration {iteration} not found in {ckpt}; available: {listed}")
        missing = missing_files(found[iteration])
        if missing:
            raise UserError(f"--iteration {iteration} in {ckpt} is incomplete (missing {', '.join(missing)}); "
                            f"complete: {', '.join(str(n) for n in complete[-8:]) or 'none'}")
        vet_checkpoint(found[iteration], ckpt)
        return found[iteration], iteration
    point = resume_point(ckpt)
    if point.iteration is None:
        hint = (f"pass --iteration N to export a complete one ({', '.join(str(n) for n in complete[-8:])})"
                if complete else "no iteration is complete either")
        raise UserError(f"--ckpt {ckpt} has no tracker ({TRACKER_PT} or {TRACKER_TXT}): no save finished, a "
                        f"run would start from scratch; {hint}")
    return found[point.iteration], point.iteration
