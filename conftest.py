"""Plugins of every test session in this repository, contrib's tests included: the vLLM
server they share (tests/helpers/shared_vllm.py)."""

pytest_plugins = ["tests.helpers.shared_vllm"]
