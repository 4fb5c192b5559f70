"""Deprecated: the trainer-side helpers the README names moved to `infer.worker.distributed.weight_sync`. This
name is that module (not a copy), with a DeprecationWarning on import; it will be removed."""

import sys
import warnings

from infer.worker.distributed import weight_sync

warnings.warn(
    "infer.worker.weight_sync is deprecated: import infer.worker.distributed.weight_sync",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = weight_sync
