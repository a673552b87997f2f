"""Our extensions to Megatron Bridge: recipe building, overrides, CLI, conversion, CPU mode."""

from bridge_ext.patches import apply as _apply_patches

# Importing megatron.bridge without Transformer Engine fails on an unguarded import (bridge_ext.patches.import_time);
# guarding it here lets any code that imports bridge_ext use Megatron Bridge on such machines. Cheap: no imports.
_apply_patches("import")
