"""Megatron checkpoints on disk: which iterations of a run's directory are complete and which one a run resumes
from (:mod:`~bridge_ext.checkpoints.iterations`), that a checkpoint from someone else runs no code
(:mod:`~bridge_ext.checkpoints.pickles`), and the torch_dist format read region by region
(:mod:`~bridge_ext.checkpoints.torch_dist`: what the streaming export and the shard checks read).

Imports nothing heavy at module level.
"""

from __future__ import annotations

from bridge_ext.checkpoints.iterations import (
    TRACKER_PT,
    TRACKER_TXT,
    ResumePoint,
    find_iteration,
    is_complete,
    iteration_dir,
    iterations,
    missing_files,
    read_tracker,
    resume_point,
)
from bridge_ext.checkpoints.pickles import vet_checkpoint

__all__ = ["TRACKER_PT", "TRACKER_TXT", "ResumePoint", "find_iteration", "is_complete", "iteration_dir", "iterations",
           "missing_files", "read_tracker", "resume_point", "vet_checkpoint"]
