"""The GPU tier behind bench/gpu_check.py, one module per job: :mod:`.plan` (the steps and tolerances),
:mod:`.worker` (one measured process), :mod:`.driver` (the steps run and saved), :mod:`.report` (the table) and
:mod:`.dry_run` (the CPU check of every step)."""
