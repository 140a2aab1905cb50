"""Generic dynamic batching for any batched callable (encoders, classifiers, rankers).

Depends on nothing else in swiftserve.
"""

from swiftserve.batching.batcher import (
    BatcherClosed,
    BatchResultError,
    DynamicBatcher,
    QueueFull,
    QueueTimeout,
    batched,
)

__all__ = ["BatchResultError", "BatcherClosed", "DynamicBatcher", "QueueFull", "QueueTimeout", "batched"]
