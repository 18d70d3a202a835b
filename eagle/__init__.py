"""EAGLE draft heads: the head module, its config and checkpoint format, and target loading.

    from eagle import EagleHead, load_target
    target = load_target("smollm2-135m")
    head = EagleHead.from_pretrained("runs/demo/head").attach(target)

This package imports none of the others (data_prep, train, infer build on it).
"""

from eagle.checkpoint import CheckpointError
from eagle.head import EagleHead, HeadCache, HeadConfig
from eagle.target import TargetError, TargetModel, load_target

__all__ = ["EagleHead", "HeadCache", "HeadConfig", "TargetModel", "load_target", "CheckpointError", "TargetError"]
