"""Execution state: the store the pod keeps of its partitions (the compacted topic is the truth)
and its restore on take-over."""
