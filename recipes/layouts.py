"""Layouts: parallelism, batch and precision of one model on a named cluster.

Each model's layouts live with its family (``recipes/families/<family>.py``, ``LAYOUTS``); :data:`LAYOUTS` here
assembles them. Adding a cluster for a model: one ``Layout`` in that model's entry of its family's ``LAYOUTS``
(the first entry is the model's default). The type, and the CPU layouts every proxy shares, are
``recipes.layout_spec``'s. ``Layout.problems`` checks a layout against the model's layer count without Megatron.
"""

from __future__ import annotations

from recipes.families import MODULES
from recipes.layout_spec import Layout, pipeline_stages

__all__ = ["LAYOUTS", "Layout", "pipeline_stages"]

# model name -> cluster name -> layout, for every model and proxy of every family
LAYOUTS: dict[str, dict[str, Layout]] = {name: layouts for m in MODULES for name, layouts in m.LAYOUTS.items()}
