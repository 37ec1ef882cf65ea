"""The RL loop trainer rank 0 drives (and ranks > 0 follow), with what surrounds it:
batching, evaluation, metrics, progress, pre-flight checks, resuming.
"""
