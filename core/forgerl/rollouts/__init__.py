"""From problems to episodes: the rollout producers (synchronous-versioned and
continuous), environments' trajectories as tokens, tool calls, and black-box agents through
the run's OpenAI-compatible endpoint.
"""
