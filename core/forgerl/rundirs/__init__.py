"""Run directories: where a run lives, what its files hold (config.yaml, loop.json's
layout), the job that runs it, and the model folder it loads.
"""
