"""Our extensions to Megatron Bridge: recipe building, overrides, CLI, conversion, CPU mode."""

from bridge_ext.cpu_mode import install_te_import_guard as _install_te_import_guard

# Importing megatron.bridge without Transformer Engine fails on one unguarded import (see cpu_mode);
# guarding it here lets any code that imports bridge_ext use Megatron Bridge on such machines.
try:
    _install_te_import_guard()
except RuntimeError:  # no supported Megatron stack installed: `nemo llm recipes` / `info` still work
    pass
