"""Heads files shipped inside this package, matched to a target model."""

from __future__ import annotations

import os

from metaloom.errors import NoSpeculatorHeads, NotAModel
from metaloom.speculative.heads.model import matches, model_signature, read_config

FOLDER = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILE = os.path.join(FOLDER, "smollm2-135m-instruct.safetensors")  # heads for the default model


def shipped_files() -> list[str]:
    return sorted(os.path.join(FOLDER, f) for f in os.listdir(FOLDER) if f.endswith(".safetensors"))


def shipped_heads(target: object) -> str:
    """The shipped heads file whose header matches ``target`` (architecture signature and
    embedding probe); raises `NoSpeculatorHeads` when there is none."""
    for path in shipped_files():
        try:
            if matches(read_config(path), target):
                return path
        except NotAModel:
            continue
    raise NoSpeculatorHeads(
        f"no speculator heads are shipped for this model ({model_signature(target)}); heads ship for the default "
        "model (SmolLM2-135M-Instruct) only. Train some with `metaloom train-speculator --model MODEL --out FILE` "
        "and pass the file (HeadsDrafter(path=FILE))")
