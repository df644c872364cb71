"""KV selection methods, one per module, behind one interface and a registry."""

# Adding a method: one new module here, and its name in this import (docs/design.md,
# "Adding a method"). Importing a module registers its methods.
from kvllm.methods import (  # noqa: F401
    adakv,
    chunkkv,
    compactor,
    expected_attention,
    h2o,
    kara,
    kara_value,
    keydiff,
    knorm,
    lagkv,
    noncausal_attn,
    pyramidkv,
    qfilter,
    random_keep,
    retain,
    rkv,
    snapkv,
    streamingllm,
    tova,
)
from kvllm.methods.base import (
    Method,
    MethodParams,
    Selection,
    Window,
    available,
    build,
    calibrated,
    method_class,
    stream_seed,
)

__all__ = [
    "Method",
    "MethodParams",
    "Selection",
    "Window",
    "available",
    "build",
    "calibrated",
    "method_class",
    "stream_seed",
]
