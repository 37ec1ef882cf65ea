"""Scoring episodes with the run's Reward plugins, in worker processes of their own.
"""
