"""Pure-Python scheduling core: requests, queues, the block manager and the scheduler.

Nothing in this package imports torch or transformers (a test asserts it), so the
scheduler and the block manager are unit-tested with fake requests in milliseconds.
"""
