"""The command line of `metaloom bench remote`: its flags (`add_args`) and the options they give
(`Options`, checked when made)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from metaloom.bench import model_args
from metaloom.bench.remote.problems import PRESETS, SEED
from metaloom.bench.remote.systems import STRATEGY_NAMES
from metaloom.errors import InvalidParameter


@dataclass(frozen=True)
class Options:
    preset: str = "addition"
    problems: int = 20
    seed: int = SEED
    n: int = 16
    max_tokens: int = 256
    temperature: float = 1.0
    strategies: tuple[str, ...] = STRATEGY_NAMES
    deadline_s: float = 0.0  # 0: none; else no new problem starts once the next would likely end past it

    def __post_init__(self) -> None:
        for name in ("problems", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidParameter(f"remote_{name}", getattr(self, name), "an integer >= 1")
        if not self.strategies or any(s not in STRATEGY_NAMES for s in self.strategies):
            raise InvalidParameter("remote_strategies", ",".join(self.strategies), f"some of {STRATEGY_NAMES}")
        if self.deadline_s < 0:
            raise InvalidParameter("remote_deadline", self.deadline_s, "seconds >= 0 (0: none)")


def options(args: argparse.Namespace) -> Options:
    strategies = tuple(s.strip() for s in str(getattr(args, "remote_strategies", ",".join(STRATEGY_NAMES))).split(",")
                       if s.strip())
    return Options(preset=getattr(args, "remote_task", "addition"), problems=getattr(args, "remote_problems", 20),
                   seed=getattr(args, "remote_seed", SEED), n=getattr(args, "remote_n", 16),
                   max_tokens=getattr(args, "remote_tokens", 256), temperature=getattr(args, "remote_temperature", 1.0),
                   strategies=strategies, deadline_s=getattr(args, "remote_deadline", 0.0))



def add_args(p: argparse.ArgumentParser) -> None:
    from metaloom.bench.servers import server_args

    model_args(p, repeats=None)
    server_args(p)
    p.add_argument("--optillm", default=None, metavar="VENV", help="an optillm venv to run beside metaloom")
    p.add_argument("--remote-task", default="addition", choices=sorted(PRESETS), help="reasoning-gym preset")
    p.add_argument("--remote-problems", type=int, default=20, help="problems")
    p.add_argument("--remote-seed", type=int, default=SEED, help="problem seed (sample seeds: this + problem)")
    p.add_argument("--remote-n", type=int, default=16, help="samples per strategy run")
    p.add_argument("--remote-tokens", type=int, default=256, help="max_tokens of each sample")
    p.add_argument("--remote-temperature", type=float, default=1.0,
                   help="sampling temperature (optillm hard-codes 1.0)")
    p.add_argument("--remote-strategies", default=",".join(STRATEGY_NAMES), help="comma-separated")
    p.add_argument("--remote-deadline", type=float, default=0.0,
                   help="seconds after which no new problem starts (0: none)")

