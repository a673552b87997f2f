"""Our extensions to Megatron Bridge: recipe building, overrides, CLI, conversion, CPU mode."""

from bridge_ext.te_guard import install_te_import_guard as _install_te_import_guard

# Importing megatron.bridge without Transformer Engine fails on an unguarded import (see te_guard); guarding
# it here lets any code that imports bridge_ext use Megatron Bridge on such machines. Cheap: no imports.
_install_te_import_guard()
