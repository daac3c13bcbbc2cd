"""``--kv-policy`` and ``--kv-budget`` on the command line, ``load()`` and ``metaloom eval``:
parsed into `EngineOptions`, a policy and budget that do not go together refused by name before
any model is read, refused with ``--backend openai`` and the transformers backend, and an eval
sweep's identity naming them only when set (as ``--kv-dtype`` in tests/test_kv_int8.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from metaloom.errors import InvalidParameter
from metaloom.models.engine.options import EngineOptions


def _args(*argv: str, remote: bool = True) -> argparse.Namespace:
    from metaloom.commands.common import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p, remote=remote)
    return p.parse_args(list(argv))


def _eval_args(*argv: str) -> argparse.Namespace:
    from metaloom.commands.evaluate import register

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["eval", "--task", "jsonl:x.jsonl", "--strategies", "greedy", "--out", "x", *argv])


def test_flags_parse_into_the_options_and_match_the_policies():
    from metaloom.commands.common import KV_POLICIES, engine_options
    from metaloom.models.engine.kv_policy import POLICIES

    assert KV_POLICIES == POLICIES
    default = engine_options(_args())  # load's defaults: the policy keys left out
    assert default == {"kv_dtype": "auto", "shared_prefix_attention": "auto"}
    assert EngineOptions(**default) == EngineOptions()
    got = engine_options(_args("--kv-policy", "streaming", "--kv-budget", "64"))
    assert got == {"kv_dtype": "auto", "shared_prefix_attention": "auto", "kv_policy": "streaming", "kv_budget": 64}
    assert EngineOptions(**got) == EngineOptions(kv_policy="streaming", kv_budget=64)  # what load builds
    for policy in ("h2o", "snapkv"):
        assert engine_options(_args("--kv-policy", policy, "--kv-budget", "100"))["kv_policy"] == policy
    with pytest.raises(SystemExit):
        _args("--kv-policy", "lru")
    with pytest.raises(SystemExit):
        _args("--kv-policy", "h2o", "--kv-budget", "many")


@pytest.mark.parametrize("argv", [["--kv-policy", "h2o"],  # no budget
                                  ["--kv-budget", "3", "--kv-policy", "streaming"],  # under the sinks + 1
                                  ["--kv-budget", "10"]])  # a budget with full, which keeps every position
def test_a_policy_and_budget_that_do_not_go_together_are_refused_naming_the_budget(argv):
    from metaloom.commands.common import engine_options

    with pytest.raises(InvalidParameter) as err:
        engine_options(_args(*argv))  # before any model is read
    assert err.value.name == "kv_budget"
    with pytest.raises(InvalidParameter) as err:
        EngineOptions(**{k: v for k, v in vars(_args(*argv)).items() if k in ("kv_policy", "kv_budget")})
    assert err.value.name == "kv_budget"
    from metaloom.commands.evaluate import setup_of

    with pytest.raises(InvalidParameter) as err:
        setup_of(_eval_args(*argv))  # eval refuses it before planning a sweep
    assert err.value.name == "kv_budget"


@pytest.mark.parametrize(("argv", "flag"), [(["--kv-policy", "h2o"], "kv-policy"),
                                            (["--kv-policy", "h2o", "--kv-budget", "64"], "kv-policy"),
                                            (["--kv-budget", "64"], "kv-budget")])
def test_remote_backend_refuses_the_policy_flags_by_name(argv, flag):
    from metaloom.commands.common import remote_generator
    from metaloom.commands.evaluate import setup_of

    args = _args("--backend", "openai", "--base-url", "http://127.0.0.1:9", *argv)
    with pytest.raises(InvalidParameter) as err:
        remote_generator(args)
    assert err.value.name == flag and "--backend openai" in str(err.value)
    with pytest.raises(InvalidParameter) as err:
        setup_of(_eval_args("--backend", "openai", "--base-url", "http://127.0.0.1:9", *argv))
    assert err.value.name == flag


def test_refuse_engine_options_names_the_policy_for_the_transformers_backend():
    from metaloom.models.load import _refuse_engine_options

    _refuse_engine_options(EngineOptions(), "gpt2")  # the defaults pass
    with pytest.raises(InvalidParameter) as err:
        _refuse_engine_options(EngineOptions(kv_policy="h2o", kv_budget=64), "gpt2")
    assert err.value.name == "kv_policy" and "transformers" in str(err.value)


def test_load_refuses_a_policy_for_the_transformers_backend(smollm):
    from metaloom.models import load

    with pytest.raises(InvalidParameter) as err:
        load("default", backend="transformers", kv_policy="streaming", kv_budget=64)
    assert err.value.name == "kv_policy" and "transformers" in str(err.value)
    for kw, name in (({"kv_policy": "h2o"}, "kv_budget"), ({"kv_budget": 8}, "kv_budget"),
                     ({"kv_policy": "lru", "kv_budget": 8}, "kv_policy")):
        with pytest.raises(InvalidParameter) as err:
            load("default", **kw)
        assert err.value.name == name


def test_load_applies_the_policy_to_the_native_model(smollm):
    from metaloom.models import load

    model = load("default", dtype="float32", weights="dense", pack=False, kv_policy="h2o", kv_budget=64).model
    assert model.options == EngineOptions(kv_policy="h2o", kv_budget=64)  # type: ignore[attr-defined]
    assert smollm.model.options == EngineOptions()


def test_eval_setup_carries_the_policy_and_its_identity_names_it_only_when_set():
    from metaloom.commands.evaluate import setup_of
    from metaloom.eval.worker import Setup

    plain = setup_of(_eval_args())
    assert (plain.kv_policy, plain.kv_budget) == ("full", None)
    assert "kv_policy" not in plain.identity() and "kv_budget" not in plain.identity()
    assert plain.identity() == Setup(task="jsonl:x.jsonl").identity()  # a sweep from before the flags resumes
    set_ = setup_of(_eval_args("--kv-policy", "snapkv", "--kv-budget", "128"))
    assert (set_.kv_policy, set_.kv_budget) == ("snapkv", 128)
    ident = set_.identity()
    assert (ident["kv_policy"], ident["kv_budget"]) == ("snapkv", 128)
    assert ident != plain.identity()
    assert setup_of(_eval_args("--kv-policy", "snapkv", "--kv-budget", "256")).identity() != ident


def test_eval_worker_loads_with_the_policy(tmp_path, monkeypatch):
    import importlib

    from metaloom.eval.worker import Setup, Worker

    load_module = importlib.import_module("metaloom.models.load")  # the module: the package's `load` is the function

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake_load(spec, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(load_module, "load", fake_load)
    with pytest.raises(Stop):
        Worker(Setup(task=f"jsonl:{path}", kv_policy="streaming", kv_budget=64, kv_dtype="int8"))
    assert (seen["kv_policy"], seen["kv_budget"], seen["kv_dtype"]) == ("streaming", 64, "int8")
