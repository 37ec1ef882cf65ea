"""Checkpoints: the trainer's state plus the loop's, in formats that run no code on load.
"""
